"""bench_decode's loop on two commits, same run: is ``after`` slower than ``before`` beyond the noise?

Each tree is a ``git archive`` of its commit in a temporary directory (default ``before``:
``c3c7ff8~1`` = 6b11cf7, the last commit before chunked prefill and tensor parallelism landed in
``inference/engine.py`` and ``inference/model/``; ``after``: HEAD). Each measurement is its own process
(``taskset -c --cpus``, the same pinning for both trees) that imports ``inference`` from its tree and
runs this checkout's ``bench_decode`` loops over it: bench_decode's model (random Llama, 8 layers,
~30M parameters, float32, the native CPU kernels), ``--batch`` requests of its mixed workload as a
``batch`` run (admit all, decode to the end) and a ``stream`` run (``--stream`` x batch requests, at
most ``batch`` in flight, slots refilled: there prefills and decodes share a step, which HEAD runs as
one mixed pass). Every step is timed on the wall clock and on the process's CPU clock
(``time.process_time``: all its threads, time descheduled for the neighbours' work not counted);
a process compiles the shapes it uses in an untimed run, then keeps the least of ``--inner`` runs.
Processes alternate A B B A, A B B A, ... (``--rounds`` rounds of one process per tree): a load
that drifts through the run weighs on both trees alike.

Printed per tree and figure: the median over rounds and the spread (max - min) / median. The
noise is what equal runs of one tree differ by in the same run (A vs A'): the larger of the two
trees' spreads. The verdict compares after / before - 1 of the medians with that noise; the paired
ratio (B over the A of the same round, run next to it) is printed beside it. Also per process: the
voluntary context switches a decode step (hand-offs between threads, each of which can wait a
scheduler slice on a loaded core); and once, whether each shape both trees compiled is the same
program (optimized HLO, source locations and instruction numbers stripped). Greedy tokens of both
trees must be equal (checked). Instruction counts were the first choice of a
load-proof measure, but this VM exposes no hardware counters (``perf stat -e instructions:u``:
"not supported") and valgrind would run XLA's compiles too at ~50x: CPU time is the figure to read,
wall time is printed alongside.

Measured 2026-12-05, A = 6b11cf7 (before chunked prefill and TP), B = HEAD, pinned to core 1,
batch 32, least of 2 runs a process; the machine's 2 cores shared with ~6 other agents
(a valgrind run, pytest, builds), load average 4.6-11.6 through the run. Run 1 (B = f32c344, 4
rounds, A B B A A B B A):

    batch run (1 prefill call, 121 decode steps; same greedy tokens in all 8 processes)
                      figure  A median A spread  B median B spread   B/A-1  noise  verdict
     decode_cpu_us_per_token  1154.605     1.8%  1158.532     5.4%   +0.3%   5.4%  within noise
     decode_wall_ms_per_step    45.098    69.9%    54.840    52.3%  +21.6%  69.9%  within noise
                   run_cpu_s     4.331     1.5%     4.349     5.2%   +0.4%   5.2%  within noise
                  run_wall_s     9.182    65.1%    10.175    59.2%  +10.8%  65.1%  within noise
                  tok_s_wall   268.070    72.2%   241.680    57.7%  +10.9%  72.2%  within noise
    stream run (64 requests, 198 decode steps, 27 steps with prompts and decodes: B's mixed passes)
     decode_cpu_us_per_token  1126.342     2.9%  1121.496     6.6%   -0.4%   6.6%  within noise
                   run_cpu_s     8.103     3.1%     7.987     6.8%   -1.4%   6.8%  within noise
                  run_wall_s    19.621    41.3%    20.070    74.4%   +2.3%  74.4%  within noise

Per process, decode CPU per token (us): A 1159 / 1150 / 1142 / 1163, B 1172 / 1197 / 1145 / 1134.
CPU time per token moved by 2-7% between equal processes while wall time moved by 30-90%: at this
load the wall figures say nothing, the CPU figures say B is within +-1% of A, inside the noise.
Run 2 (B = a68d228, 3 rounds, A B B A A B, load 3.9-8.6): batch decode CPU per token A 1153.8 us
(spread 9.4%), B 1128.2 us (10.4%): -2.2%, paired B/A per round 1.015 (0.978-1.022); run CPU -1.3%;
stream run decode +1.8% (paired 1.018, 0.991-1.068), run CPU +0.4%: within noise. Wall time per
decode step, paired: 1.48 (0.57-1.61), spread 40-87% between equal runs. Same greedy tokens.

Wall time read B slower in both runs (+10.8% and +25.9% on the batch run's median) with equal CPU
time. Not the step's work: the programs are the same (every shape both trees compile, 17 of 17 --
decode buckets 1-32, prefill, sampler -- is the same optimized HLO once source locations and
instruction numbers are stripped; B adds only the mixed shapes), and B blocks no more often: 3.50
voluntary context switches a decode step against A's 3.55 (one process each, side by side on
the two cores at load ~5; a thread that blocks more waits more slices on a loaded core). The wall
gap left is the neighbours' load (it moved one tree's wall time by up to 2.6x between runs); a run
on a quiet machine would settle it.

One host cost B added, below this noise: ``JaxRunner._decode`` builds the block-table array twice a
decode step (once in ``_decode_args``, discarded, then again for the call), ~115 us at batch 32 in
a micro-benchmark at load ~8 (0.3% of a one-core step); using ``_decode_args``' tables removes it.

    .venv/bin/python -m tests.bench.bench_decode_ab [--before REV] [--after REV] [--rounds 4] [--cpus 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
FIGURES = ("decode_cpu_us_per_token", "decode_wall_ms_per_step", "decode_switches_per_step", "run_cpu_s", "run_wall_s",
           "tok_s_wall")


def _archive(rev: str, into: Path) -> str:
    """Extract commit ``rev`` of this repository into ``into``; its full hash."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", rev], check=True, capture_output=True,
                            text=True).stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed")
    return commit


def _switches() -> int:
    """Voluntary context switches of this process's threads so far (each a thread that blocked: a
    hand-off between Python and XLA's threads; under load every one may wait a scheduler slice)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total


def _program(hlo: str) -> str:
    """A compiled program's optimized HLO without what names the tree or the trace: source locations
    (metadata and JAX's file/function/stack-frame tables) and instruction numbers (``%copy.144``)."""
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    lines = (ln for ln in hlo.splitlines()
             if not re.match(r"\s*\d+ |(FileNames|FunctionNames|FileLocations|StackFrames)$", ln))
    return "\n".join(sorted(re.sub(r"\.\d+\b", "", ln) for ln in lines))


class _Timed:
    """The runner, with every ``execute`` timed (wall, process CPU, voluntary switches) by kind of step."""

    def __init__(self, runner: object) -> None:
        self.runner = runner
        self.acc: dict[str, list[float]] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.runner, name)

    def execute(self, plan):  # noqa: ANN001, ANN201 - the tree's own StepPlan and SeqOutput
        w0, c0, s0 = time.perf_counter(), time.process_time(), _switches()
        out = self.runner.execute(plan)  # type: ignore[attr-defined]
        wall, cpu, sw = time.perf_counter() - w0, time.process_time() - c0, _switches() - s0
        kind = "decode" if not plan.prefills else "prefill" if not plan.decodes else "mixed"
        acc = self.acc.setdefault(kind, [0.0, 0.0, 0, 0, 0])
        for i, x in enumerate((wall, cpu, 1, len(plan.decodes), sw)):
            acc[i] += x
        return out


def child(tree: str, args: argparse.Namespace) -> dict[str, object]:
    """One process's measurement of ``tree``: per mode, the least of ``args.inner`` runs."""
    import importlib.util
    import zlib

    sys.path.insert(0, tree)
    spec = importlib.util.spec_from_file_location("bench_decode_here", HERE.parent / "bench_decode.py")
    assert spec and spec.loader
    bd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bd)  # its ``inference`` imports resolve in ``tree``
    import inference
    from inference.model.jax_runner import JaxRunner
    from inference.weights import write_hf_checkpoint
    from transport.common.worker_options import WorkerOptions

    assert Path(inference.__file__).resolve().is_relative_to(Path(tree).resolve()), inference.__file__
    with tempfile.TemporaryDirectory() as tmp:
        write_hf_checkpoint(tmp, bd.model_config(args.layers), seed=0)
        runner = JaxRunner.load(tmp, block_size=bd.BLOCK, num_blocks=2048, max_batch=args.batch, max_model_len=512,
                                max_prefill_batch=WorkerOptions().max_prefill_batch, attention="auto")
    timed = _Timed(runner)
    runs = {"batch": lambda: bd.run_ours(timed, bd.workload(args.batch, seed=args.batch)),
            "stream": lambda: bd.run_ours_stream(timed, bd.workload(args.batch * args.stream, seed=args.batch),
                                                 args.batch)}
    out: dict[str, object] = {"kernels": runner.kernels.attention}
    for mode, fn in runs.items():
        fn()  # compiles the shapes this mode uses; not timed
        best: dict[str, float] = {}
        for _ in range(args.inner):
            timed.acc.clear()
            w0, c0 = time.perf_counter(), time.process_time()
            gen = fn()
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            dec = timed.acc["decode"]
            got = {"run_wall_s": wall, "run_cpu_s": cpu, "tok_s_wall": sum(map(len, gen)) / wall,
                   "decode_cpu_us_per_token": dec[1] / dec[3] * 1e6, "decode_wall_ms_per_step": dec[0] / dec[2] * 1e3,
                   "decode_switches_per_step": dec[4] / dec[2]}
            best = {k: (max if k == "tok_s_wall" else min)(v, best.get(k, v)) for k, v in got.items()}
        out[mode] = {**best, "steps": {k: int(v[2]) for k, v in timed.acc.items()},
                     "tokens_crc": zlib.crc32(json.dumps(gen).encode())}
    if args.hlo_dir:  # the programs' text, for a diff by hand
        for key, exe in runner._execs.items():
            Path(args.hlo_dir, "_".join(map(str, key)) + ".txt").write_text(exe.as_text())
    out["hlo"] = {" ".join(map(str, key)): zlib.crc32(_program(exe.as_text()).encode())
                  for key, exe in runner._execs.items()}
    return out


def _spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="c3c7ff8~1", help="the baseline commit (A)")
    ap.add_argument("--after", default="HEAD", help="the commit measured against it (B)")
    ap.add_argument("--rounds", type=int, default=4, help="processes per tree")
    ap.add_argument("--cpus", default="1", help="taskset -c list every process runs on")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--stream", type=int, default=2, help="the stream run serves STREAM*batch requests")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--inner", type=int, default=2, help="runs per process; the least counts")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--hlo-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args)), flush=True)
        return 0
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("batch", "stream", "layers", "inner")]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: (Path(tmp) / name, rev) for name, rev in (("A", args.before), ("B", args.after))}
        try:
            commits = {name: _archive(rev, path) for name, (path, rev) in trees.items()}
        except subprocess.CalledProcessError as exc:  # a shallow clone: the baseline is not there
            print(f"skipped: {' '.join(exc.cmd)} failed (this needs the repository's history)")
            return 0
        for name, (_, rev) in trees.items():
            print(f"{name}: {rev} = {commits[name][:10]}")
        print(f"pinned to cpus {args.cpus}; batch {args.batch}, stream {args.stream}x, {args.layers} layers, "
              f"least of {args.inner} runs per process; load average at start "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        res: dict[str, list[dict]] = {"A": [], "B": []}
        order = [n for r in range(args.rounds) for n in (("A", "B") if r % 2 == 0 else ("B", "A"))]
        for i, name in enumerate(order):
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            proc = subprocess.run(["taskset", "-c", args.cpus, sys.executable, str(HERE), "--child",
                                   str(trees[name][0]), *passthrough], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"{name}'s process failed")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            res[name].append(got)
            print(f"  [{i + 1}/{len(order)}] {name}  load {load:.2f}  process {time.perf_counter() - t0:.0f} s  "
                  + "  ".join(f"{m}: {got[m]['decode_cpu_us_per_token']:.0f} us cpu/tok, "
                              f"{got[m]['run_wall_s']:.2f} s wall" for m in ("batch", "stream")), flush=True)
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; kernels {res['A'][0]['kernels']}")
    hlo = [res[n][0]["hlo"] for n in "AB"]
    common = sorted(set(hlo[0]) & set(hlo[1]))
    same = [k for k in common if hlo[0][k] == hlo[1][k]]
    print(f"compiled programs (optimized HLO, locations and numbering stripped): {len(same)} of the {len(common)} shapes both trees "
          f"compiled are the same; differ: {', '.join(k for k in common if k not in same) or 'none'}; "
          f"B only: {', '.join(sorted(set(hlo[1]) - set(hlo[0]))) or 'none'}")
    for mode in ("batch", "stream"):
        crcs = {r[mode]["tokens_crc"] for n in "AB" for r in res[n]}
        print(f"\n{mode} run: steps {res['B'][0][mode]['steps']}; same greedy tokens in every process: "
              f"{len(crcs) == 1}")
        print(f"{'figure':>24} {'A median':>9} {'A spread':>8} {'B median':>9} {'B spread':>8} {'B/A-1':>7} "
              f"{'noise':>6}  {'paired B/A per round':>22}  verdict")
        for fig in FIGURES:
            a, b = ([float(r[mode][fig]) for r in res[n]] for n in "AB")
            ma, mb = statistics.median(a), statistics.median(b)
            diff = (ma / mb - 1) if fig == "tok_s_wall" else (mb / ma - 1)  # + = B slower
            noise = max(_spread(a), _spread(b))
            verdict = "within noise" if abs(diff) <= noise else ("B slower" if diff > 0 else "B faster")
            if len(a) < 2:
                verdict = "no noise measured (one round)"
            paired = sorted(y / x for x, y in zip(a, b, strict=True))  # each round's two processes ran back to back
            print(f"{fig:>24} {ma:>9.3f} {_spread(a):>8.1%} {mb:>9.3f} {_spread(b):>8.1%} {diff:>+7.1%} "
                  f"{noise:>6.1%}  {statistics.median(paired):>6.3f} ({paired[0]:.3f}-{paired[-1]:.3f})  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
