"""Docs that cannot rot: the schema page, the README's stage table and set-up commands match the code."""
import json
import re
from pathlib import Path

import yaml

from rlpipe.data.schema import markdown_table
from tests.shipped import shipped_params

REPO = Path(__file__).resolve().parents[1]


def test_schema_page_is_generated_from_the_schema_module():
    assert (REPO / "docs/schema.md").read_text() == markdown_table(), "run `rlpipe schema > docs/schema.md`"


def readme_stage_rows() -> dict[str, list[str]]:
    rows = {}
    text = (REPO / "README.md").read_text()
    section = text.split("## The stages", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        m = re.match(r"^\| `(\w+)` \|.*\| ([^|]*) \|$", line)
        if m and ("`" in m.group(2) or m.group(2).strip() == "none (the whole file is a dep)"):
            rows[m.group(1)] = sorted(re.findall(r"`([\w.]+)`", m.group(2)))
    return rows


def test_readme_stage_table_lists_exactly_the_params_each_stage_declares():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    rows = readme_stage_rows()
    assert sorted(rows) == sorted(stages)
    for name, stage in stages.items():
        assert rows[name] == sorted(stage.get("params", [])), name


def test_readme_setup_commands_exist():
    readme = (REPO / "README.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    for target in ("repro", "test"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.M)
    assert "make test" in (REPO / ".ci/run").read_text()


def test_every_params_section_is_documented_in_params_yaml_comments_or_readme():
    params = yaml.safe_load(shipped_params().read_text())
    readme = (REPO / "README.md").read_text()
    for section in params:
        assert f"`{section}" in readme or f"{section}." in readme, section


# ----------------------------------------------------------------------------------------------
# docs/*.md: links, the rlpipe commands and options they name, troubleshooting messages, doc-test blocks
# ----------------------------------------------------------------------------------------------

DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def doc_test_blocks() -> list[tuple[str, int, str]]:
    """(page, index, code) of every ```bash block whose first line is `# doc-test` (run by tests/e2e)."""
    blocks = []
    for page in DOC_PAGES:
        for i, m in enumerate(FENCE.finditer(page.read_text())):
            if m.group(1) == "bash" and m.group(2).startswith("# doc-test\n"):
                blocks.append((str(page.relative_to(REPO)), i, m.group(2)))
    return blocks


def rlpipe_invocations(text: str) -> list[str]:
    """Each `rlpipe CMD ...` command line in code blocks and inline code (prose and error messages excluded)."""
    code = [m.group(2) for m in FENCE.finditer(text)]
    code += re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    found = []
    for snippet in code:
        for line in snippet.splitlines():
            for part in re.split(r"&&|\|\||[|;]|\$\(", line):
                part = part.split("#", 1)[0].strip()
                m = re.match(r"rlpipe ([a-z][a-z-]*)(?![:\w-])(.*)", part)
                if m:
                    found.append(m.group(0))
    return found


def test_every_rlpipe_command_and_option_named_in_the_docs_exists():
    from typer.main import get_command

    from rlpipe.cli import app

    commands = get_command(app).commands
    checked = 0
    for page in DOC_PAGES:
        for call in rlpipe_invocations(page.read_text()):
            words = call.split()
            assert words[1] in commands, f"{page.name}: `{call}` names no rlpipe command"
            command, rest = commands[words[1]], words[2:]
            if hasattr(command, "commands"):  # a command group (`rlpipe plots setup`): its subcommand's options
                assert rest and rest[0] in command.commands, f"{page.name}: `{call}` names no {words[1]} subcommand"
                command, rest = command.commands[rest[0]], rest[1:]
            known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
            for word in rest:
                if word.startswith("-") and not re.match(r"-\d", word):
                    assert word.split("=")[0] in known, f"{page.name}: `{call}`: no option {word}"
            checked += 1
    assert checked > 20


def test_every_docs_page_is_linked_from_the_index_and_every_relative_link_resolves():
    index = (REPO / "docs/README.md").read_text()
    for page in (REPO / "docs").glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"
    for page in DOC_PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            assert (page.parent / target.split("#")[0]).exists(), f"{page.name}: broken link {target}"


def test_troubleshooting_headings_are_real_messages():
    """Each `### `message`` heading of docs/troubleshooting.md occurs verbatim in rlpipe's source."""
    source = "\n".join(p.read_text() for p in [*(REPO / "rlpipe").rglob("*.py"), *(REPO / "stages").glob("*.py")])
    headings = re.findall(r"^### `(.+)`$", (REPO / "docs/troubleshooting.md").read_text(), re.M)
    assert len(headings) >= 15
    for fragment in headings:
        assert fragment in source, f"troubleshooting.md: {fragment!r} is no longer in any rlpipe message"


def test_the_task_pages_have_executed_examples():
    pages = {page for page, _, _ in doc_test_blocks()}
    for name in ("iterations.md", "inspect.md", "metrics-and-plots.md", "your-own-model.md"):
        assert f"docs/{name}" in pages, name


def test_the_plots_screenshot_is_small_and_referenced():
    image = REPO / "docs/img/dvc-plots.png"
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size < 300_000
    assert "(img/dvc-plots.png)" in (REPO / "docs/metrics-and-plots.md").read_text()


def test_measured_numbers_in_the_docs_come_from_the_results_file():
    """README.md and docs/*.md cite the learning curves from one file, so two pages cannot disagree."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("doc_numbers", REPO / "benchmarks/doc_numbers.py")
    doc_numbers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doc_numbers)
    results = doc_numbers.load()
    assert doc_numbers.stale(REPO, results) == [], "run `python benchmarks/doc_numbers.py`"
    readme = (REPO / "README.md").read_text()
    grpo = results["runs"]["grpo"]
    # the README's results table is the grpo run's, row by row, and the algorithms table cites its iteration 4
    for row in grpo["rows"]:
        assert f"| {row['iteration']} | {row['eval_accuracy']:.3f} | {row['train_reward_mean']:.3f} |" in readme
    assert f"<!-- value: grpo 4 -->{grpo['rows'][4]['eval_accuracy']:.3f}<!-- /value -->" in readme
    # a number edited by hand is caught
    edited = readme.replace(f"<!-- value: grpo 4 -->{grpo['rows'][4]['eval_accuracy']:.3f}",
                            "<!-- value: grpo 4 -->0.123")
    assert doc_numbers.render(edited, results, "README.md") == readme
    # the overlap tables come from benchmarks/overlap_curves.py's results: S = 1's last iteration, mean (range)
    overlap = (REPO / "docs/overlap.md").read_text()
    last = json.loads((REPO / "benchmarks/results/overlap_curves_tis_2026-11-29.json").read_text())["summary"]["S=1"][-1]
    row = f"| 1 | {last['eval_accuracy_mean']:.3f} ({last['eval_accuracy_min']:.3f}-{last['eval_accuracy_max']:.3f}) |"
    assert row in overlap
    assert doc_numbers.render(overlap.replace(row, "| 1 | 0.900 (0.890-0.910) |"), results, "overlap.md") == overlap


def exp_show_columns() -> list[str]:
    """The columns `dvc exp show` prints for this project: params by dotted key, headline metrics by key,
    or as `file:key` where several headline files share the key (DVC's rule)."""
    from rlpipe.stages.headline import HEADLINE_KEYS

    def flat(tree: dict, prefix: str = "") -> list[str]:
        return [k for key, v in tree.items()
                for k in (flat(v, f"{prefix}{key}.") if isinstance(v, dict) else [f"{prefix}{key}"])]

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    files = {stage: ("seconds", *HEADLINE_KEYS.get(stage, ())) for stage in stages}
    counts: dict[str, int] = {}
    for keys in files.values():
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
    metrics = [key if counts[key] == 1 else f"metrics/headline/{stage}.json:{key}"
               for stage, keys in files.items() for key in keys]
    return ["Experiment", *flat(yaml.safe_load(shipped_params().read_text())), *metrics]


def test_every_exp_show_keep_pattern_keeps_a_column():
    """DVC keeps a column when a --keep alternative matches its start: `accuracy` alone keeps nothing,
    since two headline files share it (the column is `metrics/headline/evaluate.json:accuracy`)."""
    columns = exp_show_columns()
    assert "metrics/headline/evaluate.json:accuracy" in columns and "kl_ref" in columns
    patterns = [m.group(1) for page in DOC_PAGES for m in re.finditer(r"--keep '([^']+)'", page.read_text())]
    assert patterns
    dead = [alt for pattern in patterns for alt in pattern.split("|")
            if not any(re.match(alt, column) for column in columns)]
    assert dead == [], f"--keep alternatives that match no `dvc exp show` column: {dead}"
