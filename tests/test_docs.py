"""The README and docs/ cannot rot: every command in their code blocks parses with the real command line (or the
script's own argument parser), every YAML recipe loads through quantkit's recipe reader, every relative link and
every repository path they name exists, every Python snippet compiles (the self-contained ones run), every option
of every command is documented in docs/cli.md, and the pages speak of the product only.

Commands are parsed, not run: an unknown option, a bad value or a missing required option fails here in
milliseconds, while the heavy work they describe is covered by the tests of each command and by the examples.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import click
import pytest
import yaml

import quantkit

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# The pages written as reference (README and docs/*.md); docs/results/ pages record measurements.
REFERENCE = [p for p in PAGES if p.parent != ROOT / "docs" / "results"]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the block's first content line
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def blocks(page: Path) -> list[Block]:
    """The code blocks of a Markdown page: fenced ones (with their language) and indented ones (language "")."""
    found, lines = [], page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            fence, lang, start = m.group(2), m.group(3).lower(), i + 1
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                i += 1
            indent = len(m.group(1))
            body = "\n".join(ln[indent:] if ln[:indent].isspace() else ln for ln in lines[start:i])
            found.append(Block(page, start + 1, lang, body + "\n"))
            i += 1
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):  # an indented block
            start = i
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                i += 1
            found.append(Block(page, start + 1, "", "\n".join(ln[4:] for ln in lines[start:i]) + "\n"))
        else:
            i += 1
    return found


def prose(page: Path) -> str:
    """A page's text outside its fenced code blocks."""
    out, inside, fence = [], False, ""
    for line in page.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if m and not inside:
            inside, fence = True, m.group(2)
        elif inside and line.strip().startswith(fence):
            inside = False
        elif not inside:
            out.append(line)
    return "\n".join(out)


SHELL = ("", "sh", "bash", "shell", "console")
PROGRAMS = ("quantkit", "python", "python3", "make")


def expand(argv: list[str]) -> list[list[str]]:
    """A usage line's variants: ``[--bits 3]`` is written out, ``gptq|awq|rtn`` gives one line per choice."""
    argv = [a.strip("[]") for a in argv if a not in ("[", "]")]
    variants = [[]]
    for arg in argv:
        choices = arg.split("|") if "|" in arg and not arg.startswith("-") else [arg]
        variants = [[*v, c] for v in variants for c in choices]
    return variants


def command_lines(page: Path) -> list[tuple[str, list[str]]]:
    """(where, argv) of every command line (quantkit, python SCRIPT, make) in the page's shell blocks, ``$ ``
    prompts and ``# comments`` removed, backslash continuations joined."""
    found = []
    for b in blocks(page):
        if b.lang not in SHELL:
            continue
        text = b.text.replace("\\\n", " ")
        for n, raw in enumerate(text.splitlines()):
            line = raw.strip().removeprefix("$ ")
            if not line or line.split()[0] not in PROGRAMS:
                continue
            try:
                argv = shlex.split(line, comments=True)
            except ValueError as exc:
                raise AssertionError(f"{b.page.name}:{b.line + n}: cannot split {line!r}: {exc}") from None
            if argv[0].startswith("python") and not (argv[1:2] and argv[1].endswith(".py")):
                continue  # python -m venv ..., python -c ...: not a command of this repository
            variants = expand(argv)
            for v, variant in enumerate(variants):
                suffix = f"#{v + 1}" if len(variants) > 1 else ""
                found.append((f"{b.page.relative_to(ROOT)}:{b.line + n}{suffix}", variant))
    return found


ALL_COMMANDS = [c for p in PAGES for c in command_lines(p)]
QUANTKIT_COMMANDS = [c for c in ALL_COMMANDS if c[1][0] == "quantkit"]
SCRIPT_COMMANDS = [c for c in ALL_COMMANDS if c[1][0] in ("python", "python3")]
MAKE_COMMANDS = [c for c in ALL_COMMANDS if c[1][0] == "make"]
YAML_BLOCKS = [b for p in PAGES for b in blocks(p) if b.lang in ("yaml", "yml")]
PYTHON_BLOCKS = [b for p in PAGES for b in blocks(p) if b.lang in ("python", "py")]


def cli_group() -> click.Group:
    """The click group behind the ``quantkit`` console script, with its commands registered."""
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "quantkit"]
    module = importlib.import_module(script.module)
    register = getattr(module, "_register_commands", None)
    groups = [g for g in vars(module).values() if isinstance(g, click.Group)]
    assert len(groups) == 1, f"{script.module} should hold the quantkit click group, found {len(groups)}"
    group = groups[0]
    if not group.commands and register is not None:
        register()
    assert group.commands, "the quantkit click group has no commands"
    return group


def parse_command(group: click.Group, argv: list[str]) -> None:
    """Parse ``quantkit ARGS`` as the command line would, down to the command's own options, without running it."""
    # --version and --help are eager options that end parsing early (click.exceptions.Exit)
    with contextlib.suppress(click.exceptions.Exit), group.make_context("quantkit", list(argv)) as ctx:
        rest = [*(ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args), *ctx.args]
        assert rest, "no command given"
        name, command, args = group.resolve_command(ctx, rest)
        assert command is not None, f"unknown command {rest[0]!r}"
        command.make_context(name, args, parent=ctx).close()


def test_pages_have_commands_and_snippets():
    """The extraction itself works: the README's tour holds commands, a recipe and Python snippets."""
    readme = [c for c in QUANTKIT_COMMANDS if c[0].startswith("README.md")]
    assert len(readme) >= 5, readme
    assert any(b.page.name == "README.md" for b in YAML_BLOCKS)
    assert any(b.page.name == "README.md" for b in PYTHON_BLOCKS)
    for name in ("cli", "recipes", "checkpoints", "formats", "runtime", "kernels", "evaluation"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), name


@pytest.mark.parametrize("where,argv", QUANTKIT_COMMANDS, ids=[w for w, _ in QUANTKIT_COMMANDS])
def test_quantkit_command_parses(where, argv):
    try:
        parse_command(cli_group(), argv[1:])
    except click.ClickException as exc:
        pytest.fail(f"{where}: {shlex.join(argv)}: {exc.format_message()}")


def test_a_bad_command_fails_to_parse():
    """The parser used above refuses what the command line refuses (else the test above could not fail)."""
    group = cli_group()
    for argv in (
        ["quantize", "--out", "x", "--no-such-option"],
        ["quantize", "--out", "x", "--seed", "abc"],
        ["quantize"],  # --out is required
        ["export", "a", "--format", "onnx", "--out", "b"],
        ["no-such-command"],
    ):
        with pytest.raises(click.ClickException):
            parse_command(group, argv)


class _Parsed(Exception):
    """Raised once a script's argparse parser has accepted its arguments, to stop before any work."""


def parse_script(argv: list[str], monkeypatch) -> str | None:
    """Run ``python SCRIPT ARGS`` in this process up to its argparse parser: None if it accepts ARGS, else why not."""
    script = ROOT / argv[1]
    if not script.is_file():
        return f"{argv[1]} does not exist"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    before = set(sys.modules)
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(sys, "argv", [str(script), *argv[2:]])
        m.syspath_prepend(str(ROOT))
        m.syspath_prepend(str(script.parent))  # as `python SCRIPT` does: its folder's modules import by name
        try:
            runpy.run_path(str(script), run_name="__main__")
        except _Parsed:
            return None
        except SystemExit as exc:
            return f"the script's parser refused it (exit {exc.code})"
        finally:  # the script's sibling modules (benchmarks' `common`) leave with it
            for name in set(sys.modules) - before:
                if script.parent in Path(getattr(sys.modules[name], "__file__", None) or "/").parents:
                    del sys.modules[name]
    return "the script ended without parsing its arguments with argparse"


@pytest.mark.parametrize("where,argv", SCRIPT_COMMANDS, ids=[w for w, _ in SCRIPT_COMMANDS])
def test_script_command_parses(where, argv, monkeypatch):
    """``python SCRIPT ARGS`` lines: the script exists and its own argparse parser accepts ARGS."""
    error = parse_script(argv, monkeypatch)
    assert error is None, f"{where}: {shlex.join(argv)}: {error}"


def test_a_bad_script_command_fails_to_parse(monkeypatch, capsys):
    assert parse_script(["python", "examples/demo.py", "--windows", "2"], monkeypatch) is None
    assert parse_script(["python", "examples/demo.py", "--no-such-option"], monkeypatch) is not None
    assert parse_script(["python", "examples/no_such_script.py"], monkeypatch) is not None


@pytest.mark.parametrize("where,argv", MAKE_COMMANDS, ids=[w for w, _ in MAKE_COMMANDS])
def test_make_target_exists(where, argv):
    makefile = (ROOT / "Makefile").read_text()
    for target in (a for a in argv[1:] if not a.startswith("-") and "=" not in a):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{where}: no make target {target!r}"


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.where for b in YAML_BLOCKS])
def test_yaml_recipe_loads(block, tmp_path):
    """A YAML block with stages is a recipe: it loads through quantkit's reader (every key checked); any other YAML
    block is at least valid YAML."""
    data = yaml.safe_load(block.text)
    if not (isinstance(data, dict) and "stages" in data):
        return
    path = tmp_path / "recipe.yaml"
    path.write_text(block.text, encoding="utf-8")
    try:
        quantkit.load_recipe(path)
    except quantkit.QuantkitError as exc:
        pytest.fail(f"{block.where}: {exc}")


# Snippets that need the real default model, a GGUF file or a GPU only compile here. Those that need no more than a
# checkpoint at out/smollm2-gptq run against a tiny quantized model saved there; the rest run as they are.
NEEDS_MORE = re.compile(r"smollm2-135m|\.gguf|\"cuda\"")
CHECKPOINT = "out/smollm2-gptq"


@pytest.fixture(scope="module")
def tiny_checkpoint_dir(tmp_path_factory):
    """A folder holding out/smollm2-gptq: a tiny Llama, quantized with the default recipe (RTN, no calibration)."""
    from tests.tiny_models import tiny_model, tiny_tokenizer

    root = tmp_path_factory.mktemp("docs")
    model = tiny_model("llama")
    quantkit.quantize(model, "default")
    quantkit.save_quantized(model, root / CHECKPOINT, tokenizer=tiny_tokenizer())
    return root


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where for b in PYTHON_BLOCKS])
def test_python_snippet(block, tmp_path, monkeypatch, capsys, request):
    code = compile(block.text, block.where, "exec")
    if NEEDS_MORE.search(block.text):
        return
    if CHECKPOINT in block.text:
        monkeypatch.chdir(request.getfixturevalue("tiny_checkpoint_dir"))
    else:
        monkeypatch.chdir(tmp_path)
    exec(code, {"__name__": "__docs__"})


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchor of every heading of a page."""
    found = set()
    for line in prose(page).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


TOP = ("quantkit", "kernels", "tests", "benchmarks", "examples", "recipes", "docs", "scripts", "calib_data")
REPO_PATH = re.compile(rf"`((?:{'|'.join(TOP)})/[\w./*-]*)`")


@pytest.mark.parametrize("page", REFERENCE, ids=[str(p.relative_to(ROOT)) for p in REFERENCE])
def test_named_paths_exist(page):
    """Files and folders the reference pages name in backticks (`kernels/w4a16/dispatch.py`) exist."""
    named = REPO_PATH.findall(prose(page))
    missing = [p for p in named if not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert not missing, f"{page.relative_to(ROOT)}: no such path {missing}"


def test_every_cli_option_is_documented():
    """docs/cli.md names every long option of every command."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    group = cli_group()
    missing = []
    for name, command in sorted(group.commands.items()):
        assert re.search(rf"^## .*\b{re.escape(name)}\b", text, re.M), f"docs/cli.md has no section on {name}"
        for param in command.params:
            for opt in [*param.opts, *getattr(param, "secondary_opts", [])]:
                documented = re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text)
                if opt.startswith("--") and opt != "--help" and not documented:
                    missing.append(f"{name} {opt}")
    assert not missing, f"docs/cli.md does not mention {missing}"


# How runs were made and by whom is no part of the product's pages.
OFF_TOPIC = re.compile(
    r"\bsessions?\b|\bleases?\b|\blent\b|device time|\bssh\b|\bscp\b|\brsync\b|gpu[_]final|job files?|"
    r"\$OUT\b|shipped to (?:a|the) machine|GPU machine",
    re.I,
)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_pages_speak_of_the_product_only(page):
    hits = [m.group(0) for m in OFF_TOPIC.finditer(page.read_text(encoding="utf-8"))]
    assert not hits, f"{page.relative_to(ROOT)}: {hits}"


def test_readme_stays_a_front_door():
    """The README stays short (~10k characters): the reference lives in docs/."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) < 12_000
