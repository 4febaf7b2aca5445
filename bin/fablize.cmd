@echo off
rem fablize for cmd.exe and PowerShell: the same engine as bin/fablize, imported as a module.
setlocal
set "FABLIZE_SCRIPTS=%~dp0..\scripts"
set "FABLIZE_CODE=import sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'fablize'; from goals import run; run()"
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
