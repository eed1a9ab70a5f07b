"""The examples in README.md, docs/server.md and docs/deploy.md, checked offline without loading a model: each
shell command parses with the CLI it calls (qwenserve's argparse, pytest markers, the Dockerfile's build args),
each curl body is a valid request of its route, each Python snippet compiles and passes only keywords its calls
take, each engine argument in the README's table is a flag, every subcommand and bench workload appears in the docs
(its --help runs), and every relative link reaches a file and heading."""
import argparse
import ast
import contextlib
import dataclasses
import io
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from qwenserve.entrypoints.cli.engine_args import engine_config_from_args
from qwenserve.entrypoints.cli.main import build_parser
from qwenserve.entrypoints.openai import protocol
from qwenserve.sample.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "server.md", ROOT / "docs" / "deploy.md"]
ROUTES = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
          "/tokenize": protocol.TokenizeRequest, "/detokenize": protocol.DetokenizeRequest}


def code_blocks(page: Path, languages: set[str]) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", page.read_text(), re.S | re.M)
            if m.group(1) in languages]


def shell_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every command in the pages' bash blocks, continued lines joined, comments dropped."""
    commands = []
    for page in PAGES:
        for block in code_blocks(page, {"bash", "sh"}):
            for line in block.replace("\\\n", " ").splitlines():
                if argv := shlex.split(line, comments=True):
                    commands.append((page.name, argv))
    return commands


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """qwenserve's own parse of argv, and the engine config its engine arguments make (which checks their values
    without loading the model); an error fails the test with its message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"qwenserve {shlex.join(argv)}: {stderr.getvalue().strip()}")
    if hasattr(args, "model"):
        engine_config_from_args(args)
    return args


def check_curl(argv: list[str]) -> None:
    url = next(a for a in argv if "/" in a and not a.startswith("-") and "{" not in a)
    route = "/" + url.split("/", 1)[1] if "://" not in url else "/" + url.split("://")[1].split("/", 1)[1]
    body = json.loads(argv[argv.index("-d") + 1])
    model = ROUTES[route]
    fields = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    assert set(body) <= fields, f"{route}: {set(body) - fields} are no fields of {model.__name__}"
    model.model_validate(body)


def check_docker(argv: list[str]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    if argv[1] == "build":
        assert argv[-1] == "." and (ROOT / "Dockerfile").is_file()
        for i, word in enumerate(argv):
            if word == "--build-arg":
                assert re.search(rf"^ARG {argv[i + 1].split('=')[0]}\b", dockerfile, re.M), argv[i + 1]
    elif argv[1] == "compose":
        assert (ROOT / argv[argv.index("-f") + 1]).is_file()
    else:
        assert argv[1] == "run", argv
        options_with_values = {"-p", "-v", "-e", "--name"}
        i = 2
        while argv[i].startswith("-"):
            i += 2 if argv[i] in options_with_values else 1
        assert argv[i] == "qwenserve:cpu", "the tag the build example gives"
        if argv[i + 1:]:
            parse_cli(argv[i + 1:])


def test_shell_examples_run_as_written():
    markers = {line.split(":")[0] for line in tomllib.loads((ROOT / "pyproject.toml").read_text())
               ["tool"]["pytest"]["ini_options"]["markers"]}
    seen = set()
    for page, argv in shell_commands():
        program = argv[0]
        seen.add(program)
        if program in ("./run.sh", "qwenserve"):
            parse_cli(argv[1:] or ["serve"])
        elif program == "./test.sh":
            if "-m" in argv:
                expr = argv[argv.index("-m") + 1]
                assert set(re.findall(r"\w+", expr)) - {"and", "or", "not"} <= markers, (page, expr)
            for path in (a for a in argv[1:] if a.startswith("tests/")):
                assert (ROOT / path).exists(), (page, path)
        elif program == "curl":
            check_curl(argv)
        elif program == "docker":
            check_docker(argv)
        else:
            pytest.fail(f"{page}: no check for the example {shlex.join(argv)}")
    assert {"./run.sh", "./test.sh", "curl", "docker"} <= seen


def test_the_readme_keeps_the_set_up_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "\n./run.sh             #" in readme and "\n./test.sh            #" in readme
    assert "exec bash test.sh" in (ROOT / ".ci" / "run").read_text()
    assert len(readme.splitlines()) < 200


def test_python_examples_compile_and_pass_keywords_their_calls_take():
    serve_flags = {o for a in subparsers(build_parser())["serve"]._actions for o in a.option_strings}
    sampling = {f.name for f in dataclasses.fields(SamplingParams)}
    snippets = [block for page in PAGES for block in code_blocks(page, {"python"})]
    assert snippets
    for snippet in snippets:
        tree = ast.parse(snippet)
        compile(tree, "<docs>", "exec")
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
            keywords = {k.arg for k in call.keywords}
            if call.func.id == "SamplingParams":
                assert keywords <= sampling, keywords - sampling
            elif call.func.id == "LLM":
                assert {"--" + k.replace("_", "-") for k in keywords} <= serve_flags, keywords
        for node in (n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "qwenserve"):
            import qwenserve
            assert all(hasattr(qwenserve, alias.name) for alias in node.names)


def test_readme_engine_arguments_are_flags():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Engine arguments")[1].split("\n## ")[0]
    names = [n for row in re.findall(r"^\| (`.*?) \|", table, re.M) for n in re.findall(r"`(\w+)`", row)]
    assert len(names) > 25
    flags = {o for a in subparsers(build_parser())["serve"]._actions for o in a.option_strings}
    missing = [n for n in names if "--" + n.replace("_", "-") not in flags]
    assert not missing, f"README's engine arguments that `qwenserve serve` does not take: {missing}"


def test_commands_in_inline_code_name_real_flags():
    """`qwenserve X ...` and `./run.sh X ...` spans in the pages: each --flag is one of that command's."""
    commands = subparsers(build_parser())
    for page in PAGES:
        for span in re.findall(r"`((?:qwenserve|\./run\.sh) [^`]+)`", page.read_text()):
            words = span.split()
            if len(words) < 2 or words[1] not in commands:
                continue
            parser = commands[words[1]]
            if words[1] == "bench" and len(words) > 2 and words[2] in subparsers(parser):
                parser = subparsers(parser)[words[2]]
            flags = {o for a in parser._actions for o in a.option_strings}
            unknown = {w.strip("[]()") for w in words if w.strip("[]").startswith("--")} - flags
            assert not unknown, f"{page.name}: `{span}`: {unknown}"


def test_every_flag_in_code_is_a_qwenserve_flag():
    """Any --flag in the pages' code (inline or blocks) is an option of some qwenserve command, but for docker's and
    pip's that the deploying examples use."""
    def every_parser(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from every_parser(sub)
    flags = {o for p in every_parser(build_parser()) for a in p._actions for o in a.option_strings}
    others = {"--build", "--build-arg", "--init", "--no-build-isolation"}
    for page in PAGES:
        text = page.read_text()
        code = re.findall(r"`([^`\n]+)`", text) + code_blocks(page, {"bash", "sh", "python", ""})
        found = {f for span in code for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span)}
        assert found, page.name
        assert found - others <= flags, f"{page.name}: {sorted(found - others - flags)} are no qwenserve flags"


def test_every_command_and_bench_workload_is_in_the_docs_and_its_help_runs():
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    commands = subparsers(build_parser())
    workloads = subparsers(commands["bench"])
    for argv in [[c] for c in commands] + [["bench", w] for w in workloads]:
        if argv[0] == "bench" and len(argv) == 1:
            continue
        assert re.search(rf"(qwenserve|run\.sh) {' '.join(argv)}\b", docs) or (
            argv[0] == "bench" and re.search(rf"bench [^`\n]*\\\| {argv[1]}\b", docs)), f"no example of {argv}"
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit:
            build_parser().parse_args([*argv, "--help"])
        assert exit.value.code == 0 and "usage: qwenserve" in out.getvalue()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_reach_a_file_and_heading(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target}"
        if anchor:
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
            assert anchor in headings, f"{page.name}: {target}"
