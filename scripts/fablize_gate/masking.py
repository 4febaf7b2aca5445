"""What a plan must never keep: secrets (token shapes, secret assignments, this environment's
secret values) and this machine's places (the repository's root, the home folder), masked in
what the engine records and prints. Pure text; the environment is read where a command starts.
"""

import json
import os
import re

from .base import fix_argv_text, last_chars, Lazy, limit_text, one_line, READ_CHUNK, regex, usage


# Secrets: whatever looks like one is masked before anything is written — a run's log and tail,
# an observed command and what the harness said of it, a --run command, evidence — the way CI
# systems mask theirs: the values of this environment's variables whose names say they are
# secret, and well-known shapes of tokens; in a command line, also the value of an assignment
# to such a name (`GITHUB_TOKEN=… pytest`). A committed plan, and a shared plan's refs, are read
# by everyone who can read the repository.
SECRET_WORDS = (r"token|secret|passw(?:or)?d|passphrase|credential|api_?key|access_?key|"
                r"private_?key|auth_?key|signing_?key")
# Well-known token shapes: the table a reader checks (docs/threat-model.md shows it too). A
# shape is its literal prefix (what a quick scan looks for first), its body, and whether the
# prefix must start a word (a prefix that also ends words: task-queue, AKIA in no word). Every
# shape also needs a body that looks random: a body that is lowercase words joined by - or _
# (sk-learn-compat-layer, xoxb-slack-bot-tests, github_pat_handling_for_…) is a phrase, not a
# token. The GitHub and Slack prefixes may follow another token's body directly (two tokens
# printed side by side are two).
SECRET_SHAPES = (
    # prefix        body                           at a word's start
    *((f"gh{k}_",   r"[A-Za-z0-9]{30,}",           False) for k in "pousr"),
    ("github_pat_", r"\w{20,}",                    False),
    *((f"xox{k}-",  r"[\w-]{10,}",                 False) for k in "abprs"),
    ("AKIA",        r"[0-9A-Z]{16}",               True),
    ("sk-",         r"(?:ant-)?[\w-]{20,}",        True),
    ("AIza",        r"[\w-]{35}",                  True),
    ("npm_",        r"[A-Za-z0-9]{36}",            True),
    ("glpat-",      r"[\w-]{20}",                  True),
    ("eyJ",         r"[\w-]{10,}\.eyJ[\w-]{10,}\.[\w-]{10,}", True),
)
# what no token's body is: lowercase words joined by - or _, up to where the word ends
PHRASE = r"(?![a-z]+(?:[-_][a-z]+)+(?![\w-]))"
# a shape's body is first tried stopping where another token begins (two tokens side by side
# are two), then whole (a token that holds another's prefix is still one)
_NOT_A_PREFIX = "(?!" + "|".join(re.escape(prefix) for prefix, _, _ in SECRET_SHAPES) + ")"
# An assignment to a name that says it is secret — it ends with the word (GITHUB_TOKEN,
# db_password, AWS_SECRET_ACCESS_KEY) or holds SECRET (SECRET_KEY_BASE) — not max_tokens,
# TOKENIZERS_PARALLELISM or password_min_length. Its value is masked unless it is no value but
# code that reads one: what the shell fills in ($GITHUB_TOKEN, ${{ secrets.X }}), a comparison
# (token==x), a null (password=None), a call or a lookup (os.environ[…], getenv(…),
# config.get(…)), process.env.X; nor what closes a call after it. Linear: a word starts it,
# and one with no `=` in it fails at once.
SECRET_ASSIGNMENT = (r"(?<![\w-])(?=\w*=)((?:\w*?(?i:" + SECRET_WORDS + r")|(?i:\w*secret\w*))=)"
                     r"(?![=$]|(?:None|null|nil|true|false|True|False)\b|[A-Za-z_][\w.]*[(\[]"
                     r"|process\.env\.)"
                     r"(?:'[^']*'|\"[^\"]*\"|[^\s'\"(),;]+)")
MASK = "***"
PRIVATE_KEY = b"PRIVATE KEY-----"


class Environment:
    """What masking takes from the environment a command runs in, read once where the command
    starts (use_environment, from cli.main) and part of every cached pattern's key: a command
    that runs in another environment (a test's) gets patterns of its own, none made behind its
    back. `home` and `pwd`: the home folder and the shell's name of the current one; `secrets`
    (found when first asked: a command that masks no secret never compiles SECRET_WORDS): the
    values of variables whose names say they are secret."""
    __slots__ = ("environ", "home", "pwd", "_secrets")

    def __init__(self, environ):
        self.environ = dict(environ)
        self.home, self.pwd = environ.get("HOME"), environ.get("PWD")
        self._secrets = None

    @property
    def secrets(self):
        """Longest first (so that none is masked half), each also as JSON writes it (what the
        harness reports arrives as JSON text)."""
        if self._secrets is None:
            names = regex("(?i)" + SECRET_WORDS)
            values = {fix_argv_text(v) for k, v in self.environ.items()
                      if len(v) >= 6 and names.search(k)}
            values |= {json.dumps(v)[1:-1] for v in values}
            self._secrets = tuple(sorted(values, key=len, reverse=True))
        return self._secrets


ENVIRONMENT = Environment({})  # the one the command runs in, set by use_environment


def use_environment(environ):
    """Mask what `environ` holds from here on (cli.main calls it as each command starts)."""
    global ENVIRONMENT
    ENVIRONMENT = Environment(environ)


def _secrets(key):
    """The pattern of what is masked in text of `kind` (str or bytes), in a command line or
    not, for the secret `values`."""
    kind, command, values = key
    text = "|".join(([SECRET_ASSIGNMENT] if command else []) +
                    [("(?<![\\w-])" if word_start else "") + re.escape(prefix) + PHRASE +
                     f"(?:{tempered(rest)}|{rest})" for prefix, rest, word_start in SECRET_SHAPES]
                    + [re.escape(v) for v in values])
    if kind is bytes:
        text = text.encode("utf-8", "surrogateescape")
    return re.compile(text)


def secret_literals(key):
    """What a text of `kind` that holds a secret holds literally: the shapes' prefixes and the
    secret `values` (a command's assignment aside, which holds `=`)."""
    kind, values = key
    literals = [prefix for prefix, _, _ in SECRET_SHAPES] + list(values)
    return literals if kind is str else [x.encode("utf-8", "surrogateescape") for x in literals]


def tempered(body):
    """A token shape's body whose characters each stop where another token begins."""
    return re.sub(r"\[[^\]]*\]|\\w", lambda m: f"(?:{_NOT_A_PREFIX}{m.group(0)})", body)


_SECRETS = Lazy(_secrets)  # (str or bytes, a command line?, the secret values) -> pattern
_LITERALS = Lazy(secret_literals)  # (str or bytes, the secret values) -> literals


def secrets_of(kind, command=False):
    """The pattern of what is masked in text of `kind` in the command's environment."""
    return _SECRETS[kind, command, ENVIRONMENT.secrets]


def mask(text, command=False):
    """`text` (str or bytes) with every secret it holds replaced by ***; a `command` line's
    assignments to a secret-looking name keep the name (`GITHUB_TOKEN=***`)."""
    if not looks_secret(text, command):
        return text
    star = MASK.encode() if type(text) is bytes else MASK
    return secrets_of(type(text), command).sub(
        lambda m: (m.lastindex and m.group(1) or star[:0]) + star, text)


def looks_secret(text, command=False):
    """Whether `text` (str or bytes; a command line's, with `command`) holds a secret. All the
    pattern finds starts with a literal — a token shape's prefix, a secret value — or, in a
    command, is an assignment, which holds `=`: a text with none of them is cleared by a scan,
    without the pattern, whose compile costs a command 6.5 ms here (a loaded 2-core machine;
    the observe hook after `pytest -q`, with the parser's width below: x0.95 CPU, medians of
    15 side by side). The environment's secret values are read once a command (Environment),
    so the scan reads no environment."""
    if not text:
        return False
    kind = type(text)
    if (not (command and (b"=" if kind is bytes else "=") in text) and
            not any(x in text for x in _LITERALS[kind, ENVIRONMENT.secrets])):
        return False
    return secrets_of(kind, command).search(text) is not None


def masked_text(name, text, root=None):
    """An agent's text as the plan keeps it: within the limit, its secrets masked, and the
    places of the machine under `root` shown relative to them (mask_places)."""
    return mask_places(mask(limit_text(name, text), command=True), root)


# Places: where this machine keeps the work and its user's files. Output names them (a
# traceback's file, pytest's rootdir, a tool under the home folder) and so do an agent's commands
# (`cd /home/alice/proj && pytest`); a plan that kept them would tell everyone who reads the
# repository the machine's layout and its user's name. What the engine records of output, of
# the harness and of an agent's words shows them as a shell would let one type them: the
# repository's root as `.`, the home folder as `~`. A command the engine runs again (a frozen
# check, a --run) is kept as given: it must run as written.
def _shown(key):
    """{place: how it is shown} of the places masked under `root` (key: root, home, pwd)."""
    root, home, pwd = key
    shown = {}
    for path, name in ((root, "."), (logical_root(root, pwd), "."), (home, "~")):
        for p in (path, path and os.path.realpath(path)):
            p = (p or "").rstrip("/")
            # a place of one folder names no one (/root, CI's and containers' user; /app): it
            # stays, as it does on other machines in the output (`scp x web:/root/`, GET /app/x)
            if p.startswith("/") and p.count("/") >= 2 and p not in shown:
                shown[p] = name
    return shown


def _places(key):
    """(pattern, {place: shown}) for text of `kind` (str or bytes) under `root`, or None."""
    kind, root, home, pwd = key
    shown = _SHOWN[root, home, pwd]
    if not shown:
        return None
    # a whole place only, the longest first (a root inside the home folder is `.`): not the end
    # of a longer path (/root in /srv/root) but where a place starts — after a space, a quote, an
    # `=`, a JSON escape (`\n/root`), a URL's `://`, a flag (`-I/root/include`), a terminal's
    # colour (`\x1b[1m/root`) — and not the start of a longer name (/root in /rootfs, /root.bak,
    # /root~), a sentence's stop aside
    text = (r"(?:(?<![\w.~/-])|(?<=\\[nrt])|(?<=://)|(?<=(?<![^\s\"'=(])-[A-Za-z])|"
            r"(?<=\\[nrt]-[A-Za-z])|(?<=[\d\[;][mK]))(?:"
            + "|".join(map(re.escape, sorted(shown, key=len, reverse=True)))
            + r")(?![\w~-]|\.[\w-])")
    if kind is bytes:
        return (re.compile(text.encode("utf-8", "surrogateescape")),
                {k.encode("utf-8", "surrogateescape"): v.encode() for k, v in shown.items()})
    return re.compile(text), shown


def logical_root(root, pwd):
    """`root` as the shell that started the engine names it (`pwd`, its $PWD), where a symlink
    on the way makes that differ from the real path the engine works with (a check's `pwd`
    says it so)."""
    if not root or not pwd or not pwd.startswith("/"):
        return None
    rel = os.path.relpath(os.path.realpath(pwd), os.path.realpath(root))
    if rel == ".":
        return pwd
    tail = "/" + rel
    if rel.startswith("..") or not pwd.rstrip("/").endswith(tail):
        return None
    return pwd.rstrip("/")[:-len(tail)]


_SHOWN = Lazy(_shown)  # (root, home, pwd) -> {place: shown}
_PLACES = Lazy(_places)  # (str or bytes, root, home, pwd) -> (pattern, shown) or None


def places_of(kind, root):
    """(pattern, {place: shown}) of the places masked in text of `kind` under `root`, in the
    command's environment, or None."""
    return _PLACES[kind, root, ENVIRONMENT.home, ENVIRONMENT.pwd]


def mask_places(text, root):
    """`text` (str or bytes) with the repository's root (`root`, when given) shown as `.` and
    the home folder as `~`, wherever a whole one of them is named."""
    if not text:
        return text
    # a whole place is first of all the place's text: most text names none (a hook's reason,
    # an observed command), and then no pattern is compiled (0.3 ms)
    shown = _SHOWN[root, ENVIRONMENT.home, ENVIRONMENT.pwd]
    if type(text) is bytes:
        shown = [p.encode("utf-8", "surrogateescape") for p in shown]
    if not any(p in text for p in shown):
        return text
    places = places_of(type(text), root)
    if places is None:
        return text
    pattern, shown = places
    dot, slash = (".", "/") if type(text) is str else (b".", b"/")

    def place(m):  # the root at a sentence's stop is `./.`: `..` would say its parent
        name = shown[m.group(0)]
        return name + slash if name == dot and m.string[m.end():m.end() + 1] == dot else name
    return pattern.sub(place, text)


def masked_tail(text, n, root):
    """The last `n` characters of what the harness reported (a command, its output), its
    secrets and places masked before it is cut, so that none is cut in half and kept: a long
    text is first cut to its last 64·n characters at a space, without the word cut in half."""
    text = text or ""
    if len(text) > 64 * n:
        text = text[-64 * n:]
        text = text[min(i for i in (text.find(" "), text.find("\n"), len(text)) if i >= 0):]
    return last_chars(mask_places(mask(text, True), root), n)


_LAST_BREAK = rb"[^\w./~:%+=@\\-][\w./~:%+=@\\-]*\Z"  # the last byte no token holds
HOLD = 4096  # bytes of a line too long to hold that wait for what follows them


class Masker:
    """Masks a stream of output, a line at a time (a secret never spans lines; a line held
    back waits for its end, up to READ_CHUNK bytes); a private key's lines are dropped whole,
    from its BEGIN line to its END line. A line longer than that is cut where no token or place
    (under `root`) goes on, its last HOLD bytes kept back for what follows them."""

    def __init__(self, root=None):
        self.carry = b""
        self.in_key = False
        self.root = root

    def cut(self, data):
        """Where to cut a line too long to hold: at a byte no token or path holds (a space, a
        quote) near its end, else there; moved back before a secret or a place that goes on
        past it (a secret's value or a path may hold a space). What matches over more than
        HOLD bytes is no token: cut through, so that the line held back stays short."""
        end = len(data) - HOLD
        found = regex(_LAST_BREAK).search(data, end - READ_CHUNK // 4, end)
        cut = found.start() + 1 if found else end
        for pattern in (secrets_of(bytes), (places_of(bytes, self.root) or [None])[0]):
            for m in pattern.finditer(data) if pattern is not None else ():
                if m.start() < cut < m.end() and m.end() - m.start() <= HOLD:
                    cut = m.start()
        return cut

    def feed(self, chunk, final=False):
        data = self.carry + chunk
        cut = len(data) if final else data.rfind(b"\n") + 1
        if not cut and len(data) >= READ_CHUNK:
            cut = self.cut(data)
        self.carry = data[cut:]
        block = data[:cut]
        if self.in_key or PRIVATE_KEY in block:
            block = self.keys(block)
        return mask(block)

    def keys(self, block):
        out = []
        for line in block.splitlines(True):
            key = PRIVATE_KEY in line
            if self.in_key:
                if key and b"-----END" in line:
                    self.in_key = False
                    out.append(MASK.encode() + line[len(line.rstrip(b"\r\n")):])
                continue
            if key and b"-----BEGIN" in line:
                self.in_key = b"-----END" not in line
                line = (line[:line.index(b"-----BEGIN")] + MASK.encode() +
                    line[len(line.rstrip(b"\r\n")):])
            out.append(line)
        return b"".join(out)


# What the plan records is read by everyone who can read the repository: a command or a text
# that carries a secret is refused where it is typed, never recorded masked.


def check_command(option, cmd):
    """A command the engine will run and record: never one that carries a secret, which the
    plan would publish and a re-run could not repeat masked."""
    if looks_secret(cmd, command=True):
        raise usage(f"{option} `{one_line(mask(cmd, command=True))}` holds what looks like a "
                    "secret, and a plan is read by everyone who can read the repository: keep "
                    "it in the environment (the command sees it there) and leave it out of the "
                    "command.", "secret_in_command")
    return limit_text(option, cmd)


def plan_text(name, text):
    """The plan's own words (its brief, a story's title, objective, acceptance items) as typed:
    never one that carries a secret, which masking would silently change."""
    if looks_secret(text):  # a token's shape or a secret's value; `max_tokens=…` is words
        raise usage(f"{name} `{one_line(mask(text))}` holds what looks like a secret, and a "
                    "plan is read by everyone who can read the repository: leave it out.",
                    "secret_in_plan")
    return limit_text(name, text)
