"""Breaks quire on purpose, one named breakage at a time, and reports which tests catch each.

A tool for checking that the tests catch the bugs they are meant to (issue 26), not part of CI.
Each breakage is a list of exact text edits (file, old text, new text), kept as data below so
that it is easy to update when the code moves. For each one the working tree (tracked files and
untracked files git does not ignore) is copied to a temporary folder, the edits are applied there,
and pytest runs in the copy with the copy's `quire` first on the path. A breakage whose old text
is not found exactly once is reported as such, never skipped silently. A clean copy runs first:
its failures are noise that the table would otherwise blame on the breakages.

    .venv/bin/python scripts/mutate.py                        # every breakage, the fast suite
    .venv/bin/python scripts/mutate.py --tests tests/test_stop_rules.py tests/test_engine.py
    .venv/bin/python scripts/mutate.py --only block-hash-ignores-parent --list
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = ["tests", "-m", "not slow"]
TIMEOUT_S = 1800


@dataclass(frozen=True)
class Edit:
    file: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str


@dataclass(frozen=True)
class Breakage:
    name: str
    edits: tuple[Edit, ...]


def breakage(name: str, file: str, old: str, new: str) -> Breakage:
    return Breakage(name, (Edit(file, old, new),))


PROTOCOL = "quire/entrypoints/openai_protocol.py"
SAMPLER = "quire/sample/sampler.py"

BREAKAGES = [
    # The API drops a vLLM sampling extra on the way to SamplingParams.
    breakage("api-drops-top_k", PROTOCOL, "top_k=self.top_k or 0,", "top_k=0,"),
    breakage("api-drops-min_p", PROTOCOL, "min_p=self.min_p or 0.0,", "min_p=0.0,"),
    breakage(
        "api-drops-presence_penalty",
        PROTOCOL,
        "presence_penalty=self.presence_penalty or 0.0,",
        "presence_penalty=0.0,",
    ),
    breakage(
        "api-drops-frequency_penalty",
        PROTOCOL,
        "frequency_penalty=self.frequency_penalty or 0.0,",
        "frequency_penalty=0.0,",
    ),
    breakage(
        "api-drops-repetition_penalty",
        PROTOCOL,
        "repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,",
        "repetition_penalty=1.0,",
    ),
    # Temperature divides the logits after top-p instead of before.
    breakage(
        "temperature-after-top-p",
        SAMPLER,
        """    logits = logits / temperature[:, None]
    if batch.max_top_k > 0:
        logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
    if batch.any_top_p:
        logits = apply_top_p(logits, batch.top_p)
""",
        """    if batch.max_top_k > 0:
        logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
    if batch.any_top_p:
        logits = apply_top_p(logits, batch.top_p)
    logits = logits / temperature[:, None]
""",
    ),
    # Min-p judges tokens by the untempered distribution.
    breakage(
        "min-p-before-temperature",
        SAMPLER,
        "probs = apply_min_p(probs, batch.min_p)",
        "probs = probs.masked_fill(apply_min_p((logits * temperature[:, None]).softmax(-1), "
        "batch.min_p) == 0, 0.0)",
    ),
    # A block's hash no longer depends on the blocks before it.
    breakage(
        "block-hash-ignores-parent",
        "quire/engine/kv_manager.py",
        'hasher.update((parent_hash or 0).to_bytes(16, "little"))',
        'hasher.update((0).to_bytes(16, "little"))',
    ),
    # Forks write into their shared partial block instead of copying it first.
    breakage(
        "copy-on-write-off",
        "quire/engine/kv_manager.py",
        "return blocks[num_computed // self.block_size].ref_count > 1",
        "return False",
    ),
    # Below min_tokens, EOS (or the stop token ids) can be sampled.
    breakage(
        "min-tokens-does-not-ban-eos",
        "quire/worker/model_runner.py",
        "banned |= params.all_stop_token_ids",
        "pass",
    ),
    breakage(
        "min-tokens-does-not-ban-stop-token-ids",
        "quire/worker/model_runner.py",
        "banned = set(params.stop_token_ids)",
        "banned = set()",
    ),
    # The weak tests of issue 26: the logprobs' column 0, a mixed prefill step, the rotary.
    breakage(
        "logprobs-column-0-is-the-top-token",
        SAMPLER,
        "lps = torch.cat([token_logprobs, top_logprobs], dim=-1)",
        "lps = torch.cat([top_logprobs[:, :1], top_logprobs], dim=-1)",
    ),
    breakage(
        "later-prefills-of-a-step-sample-their-second-to-last-row",
        "quire/worker/model_runner.py",
        "sampled.append((s, first_rows[i + 1] - 1, 0))",
        "sampled.append((s, first_rows[i + 1] - 1 - (i > 0 and not s.is_decode), 0))",
    ),
    Breakage(
        "rotary-turns-the-other-way-in-both-paths",
        (
            Edit(
                "quire/layers/rotary.py",
                "rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)",
                "rotated = torch.cat((x[..., half:], -x[..., :half]), dim=-1)",
            ),
            Edit(
                "quire/kernels/cpu/pointwise.c",
                "round_bf16(v[i] * c[i]) + round_bf16(-v[i + half] * s[i]);",
                "round_bf16(v[i] * c[i]) + round_bf16(v[i + half] * s[i]);",
            ),
            Edit(
                "quire/kernels/cpu/pointwise.c",
                "round_bf16(v[i + half] * c[i + half]) + round_bf16(v[i] * s[i + half]);",
                "round_bf16(v[i + half] * c[i + half]) + round_bf16(-v[i] * s[i + half]);",
            ),
        ),
    ),
]


@dataclass
class Result:
    name: str
    num_run: int = 0
    failed: tuple[str, ...] = ()
    problem: str | None = None  # the breakage could not be applied, or pytest did not finish


def copy_tree(destination: Path) -> None:
    """Copies the working tree as git sees it: tracked files and untracked, unignored ones."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for relative in filter(None, listed.split("\0")):
        source = ROOT / relative
        if source.is_file():
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def apply(tree: Path, edits: tuple[Edit, ...]) -> str | None:
    """Applies the edits in `tree`; returns what went wrong, or None."""
    for edit in edits:
        path = tree / edit.file
        if not path.is_file():
            return f"file not found: {edit.file}"
        text = path.read_text()
        count = text.count(edit.old)
        if count != 1:
            where = "not found" if count == 0 else f"found {count} times"
            return f"old text {where} in {edit.file}: {edit.old.strip()[:60]!r}"
        path.write_text(text.replace(edit.old, edit.new))
    return None


def run_tests(tree: Path, tests: list[str], name: str) -> Result:
    report = tree / "junit.xml"
    env = dict(
        os.environ,
        PYTHONPATH=str(tree),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONDONTWRITEBYTECODE="1",
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={report}", *tests]
    try:
        subprocess.run(command, cwd=tree, env=env, capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Result(name, problem=f"pytest ran past {TIMEOUT_S} s")
    if not report.is_file():
        return Result(name, problem="pytest wrote no report (collection failed?)")
    failed, num_run = [], 0
    for case in ET.parse(report).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        num_run += 1
        if case.find("failure") is not None or case.find("error") is not None:
            module = case.get("classname", "").rsplit(".", 1)[-1]
            failed.append(f"{module}::{case.get('name')}")
    return Result(name, num_run, tuple(failed))


def check_imports_copy(tree: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree))
    where = subprocess.run(
        [sys.executable, "-c", "import quire; print(quire.__file__)"],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not Path(where).is_relative_to(tree):
        sys.exit(f"the copy's tests would import quire from {where}, not from the copy")


def run_one(breakage: Breakage | None, tests: list[str]) -> Result:
    name = breakage.name if breakage else "(no breakage)"
    with tempfile.TemporaryDirectory(prefix="quire-mutate-") as folder:
        tree = Path(folder)
        copy_tree(tree)
        if breakage is None:
            check_imports_copy(tree)
        else:
            problem = apply(tree, breakage.edits)
            if problem is not None:
                return Result(name, problem=problem)
        return run_tests(tree, tests, name)


def verdict(result: Result, baseline: set[str]) -> str:
    if result.problem is not None:
        return f"NOT APPLIED / NO RESULT: {result.problem}"
    caught = [t for t in result.failed if t not in baseline]
    if not caught:
        return "NOT CAUGHT"
    return f"caught by {len(caught)}: " + ", ".join(caught)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", nargs="+", help="pytest arguments (default: the fast suite)")
    parser.add_argument("--only", nargs="+", help="names of the breakages to run")
    parser.add_argument("--list", action="store_true", help="list the breakages and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the clean run")
    args = parser.parse_args()
    chosen = [b for b in BREAKAGES if not args.only or b.name in args.only]
    unknown = set(args.only or ()) - {b.name for b in BREAKAGES}
    if unknown:
        sys.exit(f"unknown breakages: {', '.join(sorted(unknown))}")
    if args.list:
        for b in chosen:
            print(b.name, "->", ", ".join(sorted({e.file for e in b.edits})))
        return
    tests = args.tests or DEFAULT_TESTS

    baseline: set[str] = set()
    if not args.no_baseline:
        start = time.monotonic()
        clean = run_one(None, tests)
        baseline = set(clean.failed)
        status = clean.problem or f"{len(clean.failed)} failed"
        print(f"clean tree: {clean.num_run} tests, {status} ({time.monotonic() - start:.0f} s)")
        for test in clean.failed:
            print(f"  fails without any breakage (ignored below): {test}")

    print(f"tests: {' '.join(tests)}\n")
    print("| breakage | tests run | failed tests |")
    print("|---|---|---|")
    for b in chosen:
        result = run_one(b, tests)
        print(f"| {b.name} | {result.num_run} | {verdict(result, baseline)} |", flush=True)


if __name__ == "__main__":
    main()
