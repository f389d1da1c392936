"""Size and time to interactive of `rlpipe inspect --html` pages of a whole iteration (issue 34, item 2).

    python benchmarks/report_pages.py build DIR --rows 4096 --tokens 1000     # the iteration's artifacts
    python benchmarks/report_pages.py page DIR OUT.html [--repo PATH]         # one page, by a checkout's code
    python benchmarks/report_pages.py open OUT.html                           # time to interactive in Chromium
    python benchmarks/report_pages.py compare --rows 4096,256 --tokens 1000 --old PATH   # all of it, both codes

``build`` trains a byte-level BPE (the `tokenizers` library, 8,192 tokens, no download) on rlpipe's own
docs and source, so completions are real-looking multi-line prose and code with en dashes, arrows and
indentation; each completion is ``--tokens`` consecutive tokens of that corpus from a random offset, in
groups of 8 per prompt, with log-probs, a reference, advantages, entropies and two weighted reward
components like a real iteration's. ``page`` runs ``rlpipe inspect DIR --show ROWS --html`` through
the code of ``--repo`` (another checkout, e.g. a worktree of the commit before) in a fresh process.
``open`` loads the page in headless Chromium (network blocked, as the browser tests do) over the
DevTools protocol and reports the load event and the time until the page answers with its first
screen drawn and laid out (the script's drawn mark, then a forced layout): what a person waits for.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GROUP = 8


def _corpus() -> str:
    files = sorted([*REPO.glob("docs/*.md"), *REPO.glob("*.md"), *REPO.glob("rlpipe/**/*.py")])
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def build_tokenizer(out: Path, text: str) -> Path:
    """A byte-level BPE trained on ``text``, saved as ``out``/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    chunks = text.split("\n\n")
    tok.train_from_iterator(chunks, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def build(root: Path, *, rows: int, tokens: int, seed: int = 0) -> None:
    """Write one iteration's artifacts (rollouts, scores, ref_logprobs, advantages, token_stats, prompts)."""
    import polars as pl
    import yaml
    from tokenizers import Tokenizer

    from rlpipe.data.io import write_artifact
    from rlpipe.data.schema import ADVANTAGES, PROMPTS, REF_LOGPROBS, ROLLOUTS, SCORES, TRAIN_TOKEN_STATS
    from rlpipe.stages.generate import single_turn_columns
    from tests.inspect_project import PATHS

    rng = np.random.default_rng(seed)
    text = _corpus()
    tok = Tokenizer.from_file(str(build_tokenizer(root / "model", text)))
    stream = np.array(tok.encode(text).ids, dtype=np.int32)
    starts = rng.integers(0, stream.size - tokens, size=rows)
    ids = [stream[s:s + tokens].tolist() for s in starts]
    completions = [tok.decode(row) for row in ids]
    n = rows * tokens
    # log-probs as a policy's: most tokens near-certain, a tail of unlikely ones
    sampler = np.where(rng.random(n) < 0.7, -rng.exponential(0.02, n), -rng.exponential(1.5, n)).astype(np.float32)
    old = (sampler + rng.normal(0, 1e-3, n)).astype(np.float32)
    new = (old + rng.normal(0, 2e-2, n)).astype(np.float32)
    ref = (sampler - np.abs(rng.normal(0, 0.05, n))).astype(np.float32)
    entropy = rng.gamma(0.6, 0.8, n).astype(np.float32)
    split = lambda a: [a[i * tokens:(i + 1) * tokens].tolist() for i in range(rows)]  # noqa: E731
    pid = [i // GROUP for i in range(rows)]
    sidx = [i % GROUP for i in range(rows)]
    digit = rng.choice([0.0, 1 / 3, 2 / 3, 1.0], size=rows)
    exact = (digit == 1.0).astype(np.float64)
    reward = exact + 0.5 * digit
    group_mean = np.repeat(reward.reshape(-1, GROUP).mean(axis=1), GROUP)
    group_std = np.repeat(reward.reshape(-1, GROUP).std(axis=1, ddof=1), GROUP)
    advantage = ((reward - group_mean) / (group_std + 1e-6)).astype(np.float32)
    paths = dict(PATHS)
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump({
        "iteration": 0, "policy": {"path": "model"}, "advantage": {"estimator": "grpo"}, "paths": paths,
        "score": {"rewards": [{"name": "exact_answer", "weight": 1.0}, {"name": "digit_match", "weight": 0.5}]}}))
    a = lambda key: root / paths[key]  # noqa: E731
    prompts = rows // GROUP
    write_artifact(pl.DataFrame({"prompt_id": list(range(prompts)),
                                 "prompt": [f"Explain part {p} of the pipeline, then answer with its number."
                                            for p in range(prompts)],
                                 "prompt_token_ids": [[1, 2, 3]] * prompts, "answer": [str(p) for p in range(prompts)],
                                 "metadata": ["{}"] * prompts}), a("train_prompts"), PROMPTS)
    truncated = (rng.random(rows) < 0.1).tolist()
    meta = {"policy_version": 0}
    write_artifact(single_turn_columns(pl.DataFrame({
        "prompt_id": pid, "sample_idx": sidx, "policy_version": [0] * rows, "sample_seed": list(range(rows)),
        "prompt_token_ids": [[1, 2, 3]] * rows, "completion_token_ids": ids, "completion_text": completions,
        "completion_length": [tokens] * rows, "sampler_logprobs": split(sampler),
        "finish_reason": ["length" if t else "stop" for t in truncated], "truncated": truncated})),
        a("rollouts"), ROLLOUTS, metadata=meta)
    write_artifact(pl.DataFrame({"prompt_id": pid, "sample_idx": sidx, "reward": reward.tolist(),
                                 "correct": (exact == 1.0).tolist(), "score_error": [None] * rows,
                                 "reward_exact_answer": exact.tolist(), "reward_digit_match": digit.tolist()},
                                schema_overrides={"score_error": pl.String}), a("scores"), SCORES, metadata=meta)
    write_artifact(pl.DataFrame({"prompt_id": pid, "sample_idx": sidx, "reference_version": [0] * rows,
                                 "ref_logprobs": split(ref)}), a("ref_logprobs"), REF_LOGPROBS, metadata=meta)
    write_artifact(pl.DataFrame({
        "prompt_id": pid, "sample_idx": sidx, "advantage": advantage.tolist(),
        "token_advantages": [[float(x)] * tokens for x in advantage], "returns": [None] * rows,
        "group_size": [GROUP] * rows, "group_reward_mean": group_mean.tolist(), "group_reward_std": group_std.tolist(),
        "filtered_reason": [None] * rows},
        schema_overrides={"returns": pl.List(pl.Float32), "filtered_reason": pl.String}),
        a("advantages"), ADVANTAGES, metadata=meta)
    write_artifact(pl.DataFrame({"prompt_id": pid, "sample_idx": sidx, "old_logprobs": split(old),
                                 "entropy": split(entropy), "new_logprobs": split(new)}),
                   a("token_stats"), TRAIN_TOKEN_STATS, metadata=meta)


PAGE_SCRIPT = """
import sys, time
from rlpipe.reports import html
from rlpipe.reports.inspect import inspect_data
root, out, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
data = inspect_data(root, show=rows)
t1 = time.perf_counter()
page = html.inspect_html(data)
t2 = time.perf_counter()
open(out, "w", encoding="utf-8").write(page)
print({"inspect_data_s": round(t1 - t0, 2), "html_s": round(t2 - t1, 2)})
"""


def page(root: Path, out: Path, *, rows: int, repo: Path = REPO) -> dict:
    """Build the page with ``repo``'s code in a fresh process; its size and build times."""
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", PAGE_SCRIPT, str(root), str(out), str(rows)], env=env, cwd=repo,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"page build with {repo} failed:\n{proc.stderr[-3000:]}")
    times = eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's dict literal
    return {"bytes": out.stat().st_size, **times}


class DevTools:
    """Chromium's DevTools protocol over --remote-debugging-pipe (fds 3 and 4): no websocket library needed."""

    def __init__(self, chromium: str, extra: list[str]) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds() -> None:  # in the child: its fd 3 reads our commands, its fd 4 writes the replies
            read_end, write_end = os.dup(to_child_r), os.dup(from_child_w)  # above 4: no clash with 3 and 4
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        self._profile = tempfile.TemporaryDirectory(prefix="rlpipe-bench-chromium-", ignore_cleanup_errors=True)
        self.proc = subprocess.Popen([chromium, *extra, "--remote-debugging-pipe",
                                      f"--user-data-dir={self._profile.name}", "about:blank"],
                                     preexec_fn=fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next = 0
        self.events: list[dict] = []

    def _read(self) -> dict:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        while True:
            for i, e in enumerate(self.events):
                if e.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._read())

    def close(self) -> None:
        self.proc.terminate()  # Chromium ends its renderer and GPU processes on SIGTERM
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._profile.cleanup()


READY = ("(() => { const drawn = !document.getElementById('rlpipe-tokens') || "
         "document.documentElement.dataset.tokens === 'drawn'; if (!drawn) return null; "
         "const h = document.body.getBoundingClientRect().height; return [performance.now(), h]; })()")


def open_page(path: Path, *, width: int = 1280, height: int = 900) -> dict:
    """Navigate headless Chromium to ``path``; seconds to the load event and to the first screen answering."""
    sys.path.insert(0, str(REPO))
    from tests.browser import FLAGS, OFFLINE, chromium

    tools = DevTools(chromium(), [*FLAGS, *OFFLINE, f"--window-size={width},{height}"])
    try:
        target = next(t for t in tools.send("Target.getTargets")["targetInfos"] if t["type"] == "page")
        session = tools.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})["sessionId"]
        tools.send("Page.enable", session=session)
        started = time.perf_counter()
        tools.send("Page.navigate", {"url": path.resolve().as_uri()}, session=session)
        tools.wait_event("Page.loadEventFired")
        loaded = time.perf_counter() - started
        while True:
            answer = tools.send("Runtime.evaluate", {"expression": READY, "returnByValue": True}, session=session)
            value = answer["result"].get("value")
            if value is not None:
                break
            if time.perf_counter() - started > 120:
                raise RuntimeError(f"{path}: not drawn after 120 s")
            time.sleep(0.02)
        ready = time.perf_counter() - started
        spans = tools.send("Runtime.evaluate", {"expression": "document.querySelectorAll('span.tok').length",
                                                "returnByValue": True}, session=session)["result"]["value"]
        memory = tools.send("Runtime.evaluate", {"expression": "performance.memory.usedJSHeapSize",
                                                 "returnByValue": True}, session=session)["result"]["value"]
    finally:
        tools.close()
    return {"load_event_s": round(loaded, 2), "interactive_s": round(ready, 2), "token_spans_drawn": spans,
            "js_heap_mb": round(memory / 2**20, 1), "page_height_px": round(value[1])}


def compare(rows_list: list[int], tokens: int, old: Path | None, work: Path, results: Path) -> None:
    """For each size: build the iteration, a page by this code (and by ``old``'s), open each; one JSON line each."""
    import platform

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    for rows in rows_list:
        root = work / f"iteration-{rows}x{tokens}"
        if not (root / "params.yaml").is_file():
            t0 = time.perf_counter()
            build(root, rows=rows, tokens=tokens)
            print(f"built {root} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for label, repo in (("new", REPO), ("old", old)):
            if repo is None:
                continue
            out = work / f"{label}-{rows}x{tokens}.html"
            record = {"code": label, "repo": str(repo), "commit": commit if label == "new" else None, "rows": rows,
                      "tokens_per_row": tokens, "machine": platform.node(), "cpus": os.cpu_count(),
                      "date": time.strftime("%Y-%m-%d"), **page(root, out, rows=rows, repo=repo)}
            record["bytes_per_token"] = round(record["bytes"] / (rows * tokens), 1)
            if record["bytes"] < 600_000_000:
                record.update(open_page(out))
            print(json.dumps(record), flush=True)
            with results.open("a") as f:
                f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--rows", type=int, default=4096)
    b.add_argument("--tokens", type=int, default=1000)
    p = sub.add_parser("page")
    p.add_argument("dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--repo", type=Path, default=REPO)
    o = sub.add_parser("open")
    o.add_argument("page", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("--rows", default="4096")
    c.add_argument("--tokens", type=int, default=1000)
    c.add_argument("--old", type=Path, default=None, help="another checkout (e.g. a worktree of main) to compare")
    c.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "rlpipe-report-pages")
    c.add_argument("--results", type=Path, default=HERE / "results" / "report_pages.jsonl")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.cmd == "build":
        build(args.dir, rows=args.rows, tokens=args.tokens)
    elif args.cmd == "page":
        print(json.dumps(page(args.dir, args.out, rows=args.rows, repo=args.repo)))
    elif args.cmd == "open":
        print(json.dumps(open_page(args.page)))
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        compare([int(r) for r in args.rows.split(",")], args.tokens, args.old, args.work, args.results)


if __name__ == "__main__":
    main()
