"""Every code block of README.md and docs/*.md runs, or says in its fence that it does not.

A fenced block is a promise: ```` ```python ```` and ```` ```sh ```` / ```` ```bash ```` blocks run
here, each in a fresh process from a scratch folder that links the repository's files
(``PYTHONPATH`` = the repository), and must exit 0; the blocks assert or print what they show.
In shell blocks ``accel`` is ``python -m accel.cli`` and ``python`` this interpreter; ``curl``
fails on an HTTP error status. A line ``accel serve ...`` starts that server on a free loopback
port instead (one per command line, shared by the blocks that talk to ``127.0.0.1:8000``, whose
port is rewritten), and the session stops it with Ctrl-C, which must exit 0.

A block that is illustration only says so in its fence: ```` ```sh no-test ```` (installs,
benchmarks of minutes or hours). Even there, every ``accel`` command line must parse with the
real argument parser, every ``accel bench`` experiment must validate with its ``--set``
overrides (``accel.bench.load_config``: nothing runs), and every script named must exist. Other
fences name a language that is not run (``text``, ``json``); a fence without one, an unknown
flag, or an indented code block fails.

README's layout block must name every module and subpackage of ``accel``, ``snapkv`` and
``speculative``, and nothing that does not exist; every `accel.x` the docs name must import;
relative links and #anchors must resolve.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # not docs/results/

RUN = {"python": "python", "sh": "sh", "bash": "sh"}  # fence language -> how it runs
NOT_CODE = {"text", "json", "yaml"}  # fence languages that are shown, never run
FLAGS = {"no-test"}
DOC_PORT = 8000  # the port the docs use; rewritten to a free one
TIMEOUT = 300

# A block that loads the default model (or talks to a server that does) is a real_model test.
REAL_MODEL = re.compile(r"load_default|load_model|\baccel (generate|serve|calibrate|bench|train-heads)\b"
                        rf"|127\.0\.0\.1:{DOC_PORT}")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    flags: set[str]
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN and "no-test" not in self.flags


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file."""
    out, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{path.name}:{start}: the code block is never closed"
        i += 1
        out.append(Block(path, start, info[0].lower() if info else "", set(info[1:]), "\n".join(body) + "\n"))
    return out


ALL_BLOCKS = [b for doc in DOCS for b in blocks_of(doc)]


def _mark(block: Block):
    marks = [pytest.mark.real_model] if REAL_MODEL.search(block.code) else []
    return pytest.param(block, id=block.id, marks=marks)


# --------------------------------------------------------------------------- the rules


def test_every_block_is_run_or_marked():
    """Every fence names its language; python / sh / bash blocks run unless marked no-test; no
    unknown flags. A new unmarked block is collected by test_block below and runs."""
    assert len(DOCS) >= 3 and ALL_BLOCKS
    problems = []
    for b in ALL_BLOCKS:
        if not b.lang:
            problems.append(f"{b.id}: a fence without a language (```text for prose, ```sh for commands)")
        elif b.lang not in RUN and b.lang not in NOT_CODE:
            problems.append(f"{b.id}: language {b.lang!r} is neither run ({sorted(RUN)}) nor shown ({sorted(NOT_CODE)})")
        if b.flags - FLAGS:
            problems.append(f"{b.id}: unknown fence flags {sorted(b.flags - FLAGS)} (known: {sorted(FLAGS)})")
        if b.flags and b.lang not in RUN:
            problems.append(f"{b.id}: no-test on a block that never runs")
    assert not problems, "\n".join(problems)
    assert [b.id for b in ALL_BLOCKS if b.runs] == [p.id for p in RUN_PARAMS]


def test_no_indented_code_blocks():
    """Commands in 4-space indented blocks would escape the fence rules: fence them."""
    problems = []
    for doc in DOCS:
        fenced = False
        lines = doc.read_text(encoding="utf-8").splitlines()
        for n, (prev, line) in enumerate(zip([""] + lines, lines), start=1):
            if re.match(r"^ {0,3}(```|~~~)", line):
                fenced = not fenced
            elif not fenced and line.startswith("    ") and line.strip() and not prev.strip():
                problems.append(f"{doc.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not problems, "indented code blocks:\n" + "\n".join(problems)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_resolve():
    """Relative links and #anchors in the docs point at files and headings that exist."""
    problems = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, mailto:
            name, _, anchor = target.partition("#")
            dest = (doc.parent / name) if name else doc
            if not dest.exists():
                problems.append(f"{doc.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", dest.read_text(encoding="utf-8"), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    problems.append(f"{doc.name}: {target}: no such heading")
    assert not problems, "\n".join(problems)


def test_named_objects_exist():
    """Every `accel.x.y`, `snapkv.x`, `speculative.x` the docs name in code spans is importable:
    a module, or an attribute of one."""
    import importlib

    problems, names = [], set()
    for doc in DOCS:
        names |= set(re.findall(r"`((?:accel|snapkv|speculative)(?:\.[A-Za-z_]\w*)+)", doc.read_text(encoding="utf-8")))
    for name in sorted(names):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            problems.append(name)
    assert len(names) >= 10, names
    assert not problems, f"named in the docs but not found: {problems}"


def _commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block (continuations joined, comments dropped)."""
    out, pending = [], ""
    for line in code.replace("\\\n", " ").splitlines():
        pending += line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote spans lines
            pending += "\n"
            continue
        pending = ""
        cmd: list[str] = []
        for w in words + [";"]:
            if w in (";", "&", "&&", "||", "|"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def _accel_argv(cmd: list[str]) -> list[str] | None:
    """The arguments of an ``accel`` command (``accel ...`` or ``.venv/bin/accel ...``)."""
    while cmd and re.match(r"^[A-Z_]+=", cmd[0]):  # VAR=value prefixes
        cmd = cmd[1:]
    if cmd and Path(cmd[0]).name == "accel":
        return cmd[1:]
    return None


def test_shell_commands_parse_and_bench_files_validate():
    """In every shell block, run or not: accel command lines parse, bench experiments validate
    with their overrides, and the scripts named exist."""
    from accel.bench import ConfigError, load_config
    from accel.cli import build_parser

    parser = build_parser()
    problems, seen = [], 0
    for b in ALL_BLOCKS:
        if RUN.get(b.lang) != "sh":
            continue
        for cmd in _commands(b.code):
            argv = _accel_argv(cmd)
            if argv is not None:
                seen += 1
                try:
                    args = parser.parse_args(argv)
                except SystemExit:
                    problems.append(f"{b.id}: accel {' '.join(argv)}: the parser refuses it")
                    continue
                if getattr(args, "command", None) == "bench":
                    try:
                        load_config(ROOT / args.config, args.set)
                    except ConfigError as err:
                        problems.append(f"{b.id}: accel {' '.join(argv)}:\n{err}")
            elif cmd and Path(cmd[0]).name in ("python", "bash") and len(cmd) > 1 and cmd[1].endswith((".py", ".sh")):
                if not (ROOT / cmd[1]).is_file():
                    problems.append(f"{b.id}: {cmd[1]} does not exist")
    assert seen >= 10, seen
    assert not problems, "\n".join(problems)
    assert not problems, "\n".join(problems)


def test_readme_layout_names_what_exists():
    """README's layout block: every name in it exists, and every module and subpackage of the
    three packages is named (``__init__.py`` aside)."""
    (layout,) = [b for b in blocks_of(ROOT / "README.md") if b.lang == "text" and b.code.startswith("accel/")]
    files = set(re.findall(r"\b([a-z0-9_]+\.py)\b", layout.code))
    dirs = set(re.findall(r"\b([a-z0-9_]+)/", layout.code))
    packages = [ROOT / p for p in ("accel", "snapkv", "speculative")]
    have_files = {p.name for pkg in packages for p in pkg.rglob("*.py") if p.name != "__init__.py"
                  and "__pycache__" not in p.parts}
    have_dirs = {p.name for pkg in packages for p in pkg.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    have_dirs |= {p.name for p in ROOT.iterdir() if p.is_dir()} | {"default"}
    assert files - have_files == set(), "the layout names modules that do not exist"
    assert dirs - have_dirs == set(), "the layout names folders that do not exist"
    assert have_files - files == set(), "modules missing from README's layout"
    subpackages = {p.parent.name for pkg in packages for p in pkg.rglob("__init__.py")}
    assert subpackages - dirs == set(), "packages missing from README's layout"


# --------------------------------------------------------------------------- running blocks


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """A scratch folder holding links to the repository's entries: blocks see configs/,
    benchmarks/, docs/ ..., and what they write (runs/, heads/) stays out of the repository."""
    work = tmp_path_factory.mktemp("docs")
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv", "runs"):
            (work / entry.name).symlink_to(entry)
    return work


def _env() -> dict[str, str]:
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Servers:
    """``accel serve`` processes, one per distinct command line, stopped at the end."""

    workdir: Path
    running: dict[tuple[str, ...], tuple[subprocess.Popen, int, Path]] = field(default_factory=dict)

    def start(self, argv: list[str]) -> int:
        """The port of a running ``accel serve`` with ``argv`` (after ``serve``), started if need be."""
        argv = [a for i, a in enumerate(argv) if a != "--port" and (i == 0 or argv[i - 1] != "--port")]
        key = tuple(argv)
        if key not in self.running:
            port = _free_port()
            log = self.workdir.parent / f"serve-{len(self.running)}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen([sys.executable, "-m", "accel.cli", "serve", *argv, "--port", str(port)],
                                        cwd=self.workdir, env=_env(), stdout=out, stderr=subprocess.STDOUT)
            self.running[key] = (proc, port, log)
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, f"accel serve {' '.join(argv)} exited:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"accel serve did not come up:\n{log.read_text()}"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.3)
        return self.running[key][1]

    def stop(self) -> list[str]:
        problems = []
        for argv, (proc, _, log) in self.running.items():
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                rc = "killed"
            if rc != 0:
                problems.append(f"accel serve {' '.join(argv)} ended with {rc}:\n{log.read_text()[-3000:]}")
        return problems


@pytest.fixture(scope="session")
def servers(workdir):
    s = Servers(workdir)
    yield s
    problems = s.stop()
    assert not problems, "\n".join(problems)


def _server_line(line: str) -> list[str] | None:
    if not re.match(r"^\s*(\S*/)?accel\s+serve\b", line):
        return None
    words = shlex.split(line, comments=True)
    if words and words[-1] == "&":
        words = words[:-1]
    argv = _accel_argv(words)
    return argv[1:] if argv and argv[0] == "serve" else None


def _doc_server(block: Block) -> list[str]:
    """The ``accel serve`` arguments of the first run block of ``block``'s file that starts one."""
    for b in blocks_of(block.path):
        if b.runs and RUN[b.lang] == "sh":
            for line in b.code.splitlines():
                argv = _server_line(line)
                if argv is not None:
                    return argv
    raise AssertionError(f"{block.id} talks to 127.0.0.1:{DOC_PORT}, but no block of {block.path.name} starts a server")


def _curl_fails_on_http_errors() -> str:
    try:
        help_text = subprocess.run(["curl", "--help", "all"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return ""
    return "--fail-with-body" if "--fail-with-body" in help_text else "--fail"


SHELL_PRELUDE = """set -euo pipefail
accel() { "$DOCS_PYTHON" -m accel.cli "$@"; }
python() { "$DOCS_PYTHON" "$@"; }
curl() { command curl $DOCS_CURL_FAIL "$@"; }
"""

RUN_PARAMS = [_mark(b) for b in ALL_BLOCKS if b.runs]


@pytest.mark.parametrize("block", RUN_PARAMS)
def test_block(block: Block, workdir: Path, servers: Servers):
    code = block.code
    if RUN[block.lang] == "sh":
        kept = []
        for line in code.splitlines():
            argv = _server_line(line)
            if argv is None:
                kept.append(line)
                continue
            port = servers.start(argv)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
                assert r.status == 200 and b'"max_model_len"' in r.read()
        code = "\n".join(kept) + "\n"
    if re.search(rf"(127\.0\.0\.1|localhost):{DOC_PORT}\b", code):
        port = servers.start(_doc_server(block))
        code = re.sub(rf"(127\.0\.0\.1|localhost):{DOC_PORT}\b", rf"\g<1>:{port}", code)
    if not code.strip():
        return  # the block only started a server, checked above
    env = _env()
    if RUN[block.lang] == "python":
        argv = [sys.executable, "-c", code]
    else:
        if re.search(r"^\s*curl\b", code, re.M):
            flag = _curl_fails_on_http_errors()
            if not flag:
                pytest.skip("curl is not installed on this machine")
            env["DOCS_CURL_FAIL"] = flag
        env["DOCS_PYTHON"] = sys.executable
        argv = ["bash", "-c", SHELL_PRELUDE + code]
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    report = f"{block.id} exited {proc.returncode}\n--- code\n{code}--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    assert proc.stdout.strip(), f"{block.id} printed nothing: a block shows its result\n{report}"
    print(proc.stdout)  # shown by pytest -rP
