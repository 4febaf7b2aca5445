@echo off
rem fablize for cmd.exe and PowerShell: the same engine as bin/fablize, started by goals.py.
setlocal
set "FABLIZE_SCRIPTS=%~dp0..\scripts"
set "FABLIZE_CODE=import sys; sys.path.insert(0, sys.argv.pop(1)); import goals; goals.main('fablize')"
if defined FABLIZE_PYTHON (
  "%FABLIZE_PYTHON%" -I -S -c "%FABLIZE_CODE%" "%FABLIZE_SCRIPTS%" %*
  exit /b
)
where py >nul 2>nul
if not errorlevel 1 (
  py -3 -I -S -c "%FABLIZE_CODE%" "%FABLIZE_SCRIPTS%" %*
  exit /b
)
python -I -S -c "%FABLIZE_CODE%" "%FABLIZE_SCRIPTS%" %*
