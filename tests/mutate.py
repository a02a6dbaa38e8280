"""``make mutate``: mutation testing with mutmut 3 (docs/mutation-testing.md).

mutmut names a mutant after its file's path (``src/`` stripped), and it imports the mutated
copy through ``sys.path``; this repository's root *is* the package ``attnplug``, so each
target is staged as ``build/mutate/<target>/src/attnplug`` (a copy of the package) next to
a copy of ``tests/`` and of ``pyproject.toml`` whose ``[tool.mutmut]`` table gets the
target's ``only_mutate`` and test selection. mutmut then runs, per mutant, only the tests
of that selection that reached the mutated function.

Usage (from the repo root, with the venv's python)::

    python tests/mutate.py                                  # every target (long)
    python tests/mutate.py runner/execute/sampler.py        # one module, a few minutes
    python tests/mutate.py runner/step/prepare.py --jobs 2
    python tests/mutate.py cache_groups/block_pool.py cache_groups/block_table.py   # one staging

Prints, per module, the mutants killed / not killed / equivalent (listed in docs/mutation-testing.md)
and the score ``killed / (total - equivalent)``, then every surviving mutant's mutated line.
Exit status 1 when a module scores under ``--min-score`` (default 0: report only).
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = ROOT / "build" / "mutate"
STEP_TESTS = ["tests/runner/step/test_step_oracle.py", "tests/runner/step/test_input_batch.py",
              "tests/runner/step/test_native_paths.py", "tests/runner/step/test_bad_input.py",
              "tests/runner/step/test_row_moves_sampling.py", "tests/runner/execute/test_cudagraph_padding_stale.py",
              "tests/runner/execute/test_sliding_window_runner.py", "tests/runner/step/test_worked_examples.py",
              "tests/runner/step/test_apply_windows.py", "tests/runner/step/test_bad_input_fuzz.py",
              "tests/runner/step/test_spec_decode.py", "tests/runner/step/test_spec_decode_bad_input.py",
              "tests/runner/step/test_spec_decode_oracle.py", "tests/runner/serve/test_spec_decode_rollback.py",
              "tests/runner/step/test_placeholders.py", "tests/runner/step/test_stage1_refusals_and_bounds.py", "tests/runner/step/test_stage8_refusals_and_draft_bounds.py",
              "tests/runner/step/test_error_messages.py", "tests/runner/step/test_async_patch_fused_into_prepare.py",
              "tests/runner/step/test_packed_drafts_and_appends.py",
              "tests/runner/step/test_block_ids_distinct_and_window_goback.py",
              "tests/runner/step/test_block_id_bound_kept_by_row_writes.py",
              "tests/runner/step/test_sampling_params_bounds.py", "tests/runner/step/test_uniform_drafts_layout.py",
              "tests/runner/step/test_async_and_stage8_bad_input_changes_nothing.py",
              "tests/runner/step/test_request_ids_one_typing_rule_on_every_path.py",
              "tests/runner/step/test_fill_output_tokens_trusts_rows_only_while_no_request_moved.py",
              "tests/runner/step/test_patch_plan_kernel_matches_a_reference.py",
              "tests/runner/step/test_step_layout_refuses_bad_pools_and_windows.py",
              "tests/runner/step/test_host_tokens_only_an_exact_cpu_int64_vector.py",
              "tests/runner/step/test_stage8_takes_the_compiled_pass.py",
              "tests/runner/step/test_image_and_embedding_refusals_name_field_and_words.py",
              "tests/runner/step/test_image_slices_complete_at_the_spans_last_token.py",
              "tests/runner/step/test_prepare_inputs_refuses_bad_arguments_before_the_patch.py"]
TARGETS: dict[str, list[str]] = {
    # module glob (repo-relative)      -> the tests that guard it
    "runner/execute/sampler.py": ["tests/runner/execute/test_sampler.py"],
    "runner/execute/cudagraph.py": ["tests/runner/execute/test_cudagraph_padding.py",
                                    "tests/runner/execute/test_cudagraph_padding_stale.py",
                                    "tests/runner/execute/test_cudagraph_negotiation.py"],
    "core/validation.py": ["tests/core"],
    "cache_groups/*.py": ["tests/cache_groups"],  # module-level tests only (issue 23)
    "runner/step/*.py": STEP_TESTS,
    "runner/step/check/*.py": STEP_TESTS,
    "backends/flash_attn/builder.py": ["tests/backends/flash_attn/test_builder.py",
                                       "tests/backends/flash_attn/test_cascade_clamp.py",
                                       "tests/backends/flash_attn/test_builder_bounds_cascade_and_own_buffers.py",
                                       "tests/backends/common/test_warm_builds_refuse_bad_steps.py"],
    "backends/flashinfer/builder.py": ["tests/backends/flashinfer/test_builder.py",
                                       "tests/backends/flashinfer/test_builder_plan_arguments_and_refusals.py"],
    "backends/triton/builder.py": ["tests/backends/triton/test_builder.py",
                                   "tests/backends/triton/test_builder_split_cascade_and_graph_copies.py",
                                   "tests/backends/common/test_warm_builds_refuse_bad_steps.py"],
    "backends/torch_native/builder.py": ["tests/backends/torch_native", "tests/runner/execute/test_cudagraph_padding.py"],
}
NOT_TARGETS = {"runner/step/oracle.py", "runner/step/debug.py"}  # the tests' own reference and views
SKIP = {".venv", ".venv-vllm", "build", "dist", ".git", "tests", "docs", "mutants", "__pycache__", ".hypothesis"}
KILLED = ("killed", "timeout", "segfault", "caught by type check")
EQUIVALENT = re.compile(r"^- `(?P<func>[\w.]+)`: `(?P<line>.+?)` — ")


def modules_of(args: str | list[str] | None) -> dict[str, list[str]]:
    """``{module path: tests}`` for ``args`` (files or folders; ``None`` or ``[]``: every target)."""
    if isinstance(args, list) and args:
        out = {}
        for a in args:
            out.update(modules_of(a))
        return out
    arg = args or None
    files = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                   if not SKIP & set(p.relative_to(ROOT).parts) and not p.name == "__init__.py")
    out = {}
    for f in files:
        if f in NOT_TARGETS or arg is not None and not (f == arg.rstrip("/") or f.startswith(arg.rstrip("/") + "/")):
            continue
        for glob, tests in TARGETS.items():
            if fnmatch.fnmatch(f, glob) and "/" not in f[len(glob.rsplit("/", 1)[0]) + 1:]:
                out[f] = tests
                break
    if not out:
        raise SystemExit(f"mutate: {arg!r} matches no target; targets: {', '.join(TARGETS)}")
    return out


def mutmut_table(only: list[str], tests: list[str]) -> str:
    """The repo's ``[tool.mutmut]`` table plus this run's files and tests (TOML)."""
    import tomllib

    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    base = {**base, "only_mutate": [f"src/attnplug/{m}" for m in only],
            "pytest_add_cli_args_test_selection": tests}
    lines = ["[tool.mutmut]"]
    for k, v in base.items():
        val = ("true" if v else "false") if isinstance(v, bool) else (
            "[" + ", ".join(f'"{x}"' for x in v) + "]" if isinstance(v, list) else
            (f'"{v}"' if isinstance(v, str) else repr(v)))
        lines.append(f"{k} = {val}")
    return "\n".join(lines) + "\n"


def stage(name: str, only: list[str], tests: list[str], keep: bool) -> Path:
    """``build/mutate/<name>``: ``src/attnplug`` (the package), ``tests/``, ``docs/``, ``pyproject.toml``."""
    where = STAGE / name
    if where.exists() and not keep:
        shutil.rmtree(where)
    ignore = shutil.ignore_patterns(*SKIP, "*.egg-info")
    shutil.copytree(ROOT, where / "src" / "attnplug", ignore=ignore, dirs_exist_ok=True)
    shutil.copytree(ROOT / "tests", where / "tests", ignore=shutil.ignore_patterns("__pycache__"),
                    dirs_exist_ok=True)
    shutil.copytree(ROOT / "docs", where / "docs", dirs_exist_ok=True)
    shutil.copy2(ROOT / "README.md", where / "README.md")
    text = (ROOT / "pyproject.toml").read_text()
    head = text.split("[tool.mutmut]")[0]
    rest = text.split("[tool.mutmut]", 1)[1]
    tail = rest[rest.index("\n[") + 1:] if "\n[" in rest else ""
    (where / "pyproject.toml").write_text(head + mutmut_table(only, tests) + "\n" + tail)
    return where


def mutmut(where: Path, *args: str, capture: bool = True, check: bool = True) -> str:
    exe = Path(sys.executable).parent / "mutmut"
    env = {k: v for k, v in os.environ.items() if k != "ATTNPLUG_VALIDATE"}  # the module tests alone
    env["ATTNPLUG_MUTATE"] = "1"  # the property tests run fewer examples per mutant
    env.setdefault("OMP_NUM_THREADS", "1")  # two spinning OpenMP threads per child starve each other
    res = subprocess.run([str(exe), *args], cwd=where, env=env, text=True,
                         stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None)
    if check and res.returncode not in (0, 1) and args[0] == "run":
        raise SystemExit(f"mutate: mutmut {' '.join(args)} failed ({res.returncode}) in {where}")
    return res.stdout or ""


def equivalents() -> dict[tuple[str, str], str]:
    """``{(function, mutated line): kind}`` listed in docs/mutation-testing.md: kind ``"equivalent"``
    (no input tells it apart) or ``"cpu"`` (only a CUDA device does)."""
    out, kind = {}, None
    for line in (ROOT / "docs" / "mutation-testing.md").read_text().splitlines():
        if line.startswith("## "):
            kind = {"## Equivalent mutants": "equivalent", "## CPU-equivalent mutants": "cpu"}.get(line.strip())
        m = EQUIVALENT.match(line)
        if m and kind:
            out[(m["func"], " ".join(m["line"].split()))] = kind
    return out


def mutated_lines(where: Path, name: str) -> str:
    diff = mutmut(where, "show", name)
    plus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return " ".join(" ".join(plus).split())


def not_killed(where: Path, modules: list[str]) -> list[str]:
    """The mutants of ``modules`` an earlier run in ``where`` did not kill (mutmut's own results)."""
    prefixes = tuple("attnplug." + m[:-3].replace("/", ".") + "." for m in modules)
    out = []
    for line in mutmut(where, "results", "--all", "true").splitlines():
        if ": " in line.strip():
            name, status = line.strip().rsplit(": ", 1)
            if name.startswith(prefixes) and status not in KILLED:
                out.append(name)
    return out


def all_results(where: Path) -> dict[str, str]:
    """``{mutant name: mutmut's status}`` for every mutant generated in ``where``."""
    results = {}
    for line in mutmut(where, "results", "--all", "true").splitlines():
        if ": " in line.strip():
            name, status = line.strip().rsplit(": ", 1)
            results[name] = status
    return results


def verdicts(where: Path) -> dict[Path, tuple[dict[str, int | None], dict[str, str]]]:
    """Every ``.meta`` file's verdicts (``exit_code_by_key``) and function hashes in ``where``."""
    import json

    out = {}
    for f in (where / "mutants").rglob("*.meta"):
        data = json.loads(f.read_text())
        out[f] = (data["exit_code_by_key"], data.get("hash_by_function_name", {}))
    return out


def restore_verdicts(where: Path, old: dict[Path, tuple[dict[str, int | None], dict[str, str]]]) -> None:
    """Put back the verdicts a ``--survivors`` run's reset dropped (mutmut resets every
    result when the test selection changes, e.g. a new test file): a mutant killed before
    stays killed, since adding tests cannot make the test that killed it pass. Only for
    functions whose code did not change (same hash): a changed function's mutants are new
    ones under old names, left "not checked" for the next ``--survivors`` run."""
    import json

    for f, (codes, hashes) in old.items():
        if not f.exists():
            continue
        data = json.loads(f.read_text())
        now, now_hashes = data["exit_code_by_key"], data.get("hash_by_function_name", {})
        for key, code in codes.items():
            func = key.rsplit("__mutmut_", 1)[0].rsplit(".", 1)[-1]
            same = hashes.get(func) is not None and hashes.get(func) == now_hashes.get(func)
            if key in now and now[key] is None and code is not None and same:
                now[key] = code
        f.write_text(json.dumps(data, indent=4))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion ``k / n`` (a sampled score's uncertainty)."""
    if n == 0:
        return 0.0, 1.0
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


def draw_sample(where: Path, modules: list[str], fraction: float, seed: int) -> list[str]:
    """A seeded random ``fraction`` of each module's mutants (at least one each), generating
    the mutants first if ``where`` has none yet (a ``mutmut run`` that matches nothing:
    mutmut generates every mutant and collects its stats, then stops)."""
    results = all_results(where)
    if not results:
        mutmut(where, "run", "--max-children", "1", "attnplug.no-such-mutant", check=False)
        results = all_results(where)
    rng, out = random.Random(seed), []
    for mod in modules:
        prefix = "attnplug." + mod[:-3].replace("/", ".") + "."
        mine = sorted(n for n in results if n.startswith(prefix))
        if mine:
            out += rng.sample(mine, max(1, round(fraction * len(mine))))
    return out


def report(where: Path, modules: list[str], equiv: dict[tuple[str, str], str], min_score: float,
           only: set[str] | None = None) -> bool:
    """Print each module's score (over ``only``, a sample, when given) and its survivors."""
    results = all_results(where)
    if only is not None:
        results = {n: s for n, s in results.items() if n in only}
    ok, sums = True, [0, 0]
    for mod in modules:
        prefix = "attnplug." + mod[:-3].replace("/", ".") + "."
        mine = {n: s for n, s in results.items() if n.startswith(prefix)}
        killed = sum(s in KILLED for s in mine.values())
        survivors = sorted((n for n, s in mine.items() if s not in KILLED),
                           key=lambda n: (n.rsplit("__mutmut_", 1)[0], int(n.rsplit("_", 1)[1])))
        listed, open_ = {"equivalent": [], "cpu": []}, []
        for n in survivors:
            line = mutated_lines(where, n)
            kind = equiv.get((n.rsplit("__mutmut_", 1)[0], line))
            (listed[kind] if kind else open_).append((n, mine[n], line))
        if any(status == "not checked" for _, status, _ in open_):
            print(f"mutate: {mod}: mutants not checked: mutmut did not finish (see its output above)")
            ok = False
        n_eq, n_cpu = len(listed["equivalent"]), len(listed["cpu"])
        total = len(mine) - n_eq - n_cpu
        score = killed / total if total else 1.0
        ok &= score >= min_score
        sums[0] += killed
        sums[1] += total
        print(f"\n{mod}: {len(mine)} mutants{' (sampled)' if only is not None else ''}, {killed} killed, {len(open_)} not killed, {n_eq} equivalent, "
              f"{n_cpu} CPU-equivalent (docs/mutation-testing.md); score {killed}/{total} = {100 * score:.1f}% "
              f"(counting the CPU-equivalent as not killed: {killed}/{total + n_cpu} = "
              f"{100 * killed / max(1, total + n_cpu):.1f}%)")
        for n, status, line in open_:
            print(f"    {status:9} {n}: {line}")
    if only is not None:
        lo, hi = wilson(*sums)
        print(f"\nsample of {len(only)} mutants: {sums[0]}/{sums[1]} = {100 * sums[0] / max(1, sums[1]):.1f}% "
              f"killed of the non-equivalent; 95% interval {100 * lo:.1f}-{100 * hi:.1f}% (Wilson)")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("module", nargs="*", help="modules or folders, repo-relative (default: every target); "
                                              "those guarded by the same tests share one mutmut run")
    ap.add_argument("--jobs", type=int, default=None, help="mutmut --max-children (default: the CPUs)")
    ap.add_argument("--keep", action="store_true", help="reuse build/mutate/<target> (mutmut's cache)")
    ap.add_argument("--survivors", action="store_true",
                    help="reuse build/mutate/<target> (implies --keep) and rerun only the mutants its last run "
                         "did not kill, against the current tests (after adding tests for them)")
    ap.add_argument("--min-score", type=float, default=0.0, help="fail under this score (0..1)")
    ap.add_argument("--sample", type=float, default=None, metavar="FRACTION",
                    help="run a seeded random FRACTION (0..1] of each module's mutants and report the score "
                         "over them with its 95%% interval (for folders too large to run whole)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    a = ap.parse_args(argv)
    targets = modules_of(a.module)
    by_tests: dict[tuple[str, ...], list[str]] = {}
    for mod, tests in targets.items():
        by_tests.setdefault(tuple(tests), []).append(mod)
    equiv, ok = equivalents(), True
    for tests, mods in by_tests.items():
        name = mods[0].replace("/", "_")[:-3] if len(mods) == 1 else mods[0].rsplit("/", 1)[0].replace("/", "_")
        where = stage(name, mods, list(tests), a.keep or a.survivors)
        sample = draw_sample(where, mods, a.sample, a.seed) if a.sample else None
        names = not_killed(where, mods) if a.survivors else []
        if sample is not None:
            names = [n for n in names if n in set(sample)] if a.survivors else sample
        print(f"mutate: {', '.join(mods)} against {' '.join(tests)} (in {where.relative_to(ROOT)})"
              + (f", rerunning the {len(names)} mutants not killed" if a.survivors else "")
              + (f", a sample of {len(sample)} (fraction {a.sample}, seed {a.seed})" if sample else ""), flush=True)
        before = verdicts(where) if a.survivors else {}
        if not a.survivors or names:
            mutmut(where, "run", *(["--max-children", str(a.jobs)] if a.jobs else []), *names, capture=False)
        restore_verdicts(where, before)
        ok &= report(where, mods, equiv, a.min_score, only=set(sample) if sample is not None else None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
