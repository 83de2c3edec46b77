"""PET operator scheduling (PetS §4.2, Alg. 2) on the CPU: the PET operators of one layer
stage spread over parallel lanes (threads of one torch thread each), an experiment.

Within a stage of a layer (the q/k/v projections, then o, ffn_in, ffn_out) the PET operators
of different tenants touch disjoint rows and different targets touch different outputs, so
they have no data dependency. ``split_ops`` cuts a stage's work into operators (a kind, a
target, a stretch of at most ``chunk`` segments of a run), ``intensity`` gives each its FLOPs
and bytes (operational intensity = FLOPs / bytes; compute-bound above the machine's ridge
point, memory-bound below), and ``assign_lanes`` places them PetS-style: longest predicted
time first (roofline: max(FLOPs / peak, bytes / bandwidth)) onto the least-loaded lane,
alternating compute- and memory-bound operators so that each lane mixes both. ``run_lanes``
runs the lanes on a thread pool. The executor itself runs every stage as one batched call
per kind and target (one lane with torch's intra-op threads); benchmarks/bench_pet_lanes.py
measures the two against each other.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from runtime.exec import cpu_batched

__all__ = ["PetOp", "assign_lanes", "intensity", "run_lanes", "split_ops"]


@dataclass
class PetOp:
    kind: str  # lora | bias | diff | adapter
    target: str
    run: tuple  # (row0, row1, n, t0), a stretch of a cpu_batched run
    weights: dict
    x: torch.Tensor  # the projection's input (rows, d_in)
    y: torch.Tensor  # the projection's output (rows, d_out), edited in place
    flops: float = 0.0
    bytes: float = 0.0

    def __call__(self):
        r, w = [self.run], self.weights
        if self.kind == "lora":
            cpu_batched.lora(self.y, self.x, r, w["A"], w["B"], w["scales"])
        elif self.kind == "bias":
            cpu_batched.bias(self.y, r, w["delta"])
        elif self.kind == "diff":
            cpu_batched.diff(self.y, self.x, r, w["index"], w["value"], w["offsets"])
        elif self.kind == "adapter":
            cpu_batched.adapter(self.y, r, w["down"], w["down_bias"], w["up"], w["up_bias"])
        else:
            raise ValueError(f"no lane operator for {self.kind!r}")


def intensity(op: PetOp) -> tuple[float, float]:
    """(FLOPs, bytes moved) of an operator, fp32."""
    r0, r1, n, t0 = op.run
    rows = r1 - r0
    d_in, d_out = op.x.shape[1], op.y.shape[1]
    w = op.weights
    if op.kind == "lora":
        r = w["A"].shape[1]
        return 2.0 * rows * r * (d_in + d_out), 4.0 * (rows * (d_in + 2 * d_out) + n * r * (d_in + d_out))
    if op.kind == "adapter":
        b = w["down"].shape[1]
        return 4.0 * rows * b * d_out, 4.0 * (3 * rows * d_out + 2 * n * b * d_out)
    if op.kind == "bias":
        return float(rows * d_out), 4.0 * (2 * rows * d_out + n * d_out)
    if op.kind == "diff":
        offs = w["offsets"]
        nnz = float(offs[t0 + n] - offs[t0])
        return 2.0 * nnz * rows / max(n, 1), 4.0 * (rows * (d_in + 2 * d_out)) + 8.0 * nnz
    raise ValueError(op.kind)


def split_ops(stage: dict, chunk: int = 16) -> list:
    """PetOps of a stage: {target: (x, y, {kind: (runs, weights)})}; runs cut into stretches
    of at most `chunk` segments."""
    ops = []
    for target, (x, y, kinds) in stage.items():
        for kind, (runs, w) in kinds.items():
            for r0, r1, n, t0 in runs:
                size = (r1 - r0) // n
                for j in range(0, n, chunk):
                    m = min(chunk, n - j)
                    op = PetOp(kind, target, (r0 + j * size, r0 + (j + m) * size, m, t0 + j), w, x, y)
                    op.flops, op.bytes = intensity(op)
                    ops.append(op)
    spans = sorted((op.target, op.run[0], op.run[1]) for op in ops)
    for (ta, _, a1), (tb, b0, _) in itertools.pairwise(spans):
        if ta == tb and b0 < a1:  # two kinds on the same rows of a target: order matters
            raise ValueError(f"PET operators overlap on {ta}; lanes need one kind per tenant and target")
    return ops


def assign_lanes(ops: list, lanes: int, peak_flops: float = 5e10, bandwidth: float = 1e10) -> list:
    """Alg. 2: operators onto `lanes` lanes, longest predicted time first onto the least
    loaded lane, compute- and memory-bound operators taken alternately. Returns [[PetOp]]."""
    ridge = peak_flops / bandwidth

    def predicted(op):
        return max(op.flops / peak_flops, op.bytes / bandwidth)

    compute = sorted((o for o in ops if o.flops / max(o.bytes, 1.0) >= ridge), key=predicted, reverse=True)
    memory = sorted((o for o in ops if o.flops / max(o.bytes, 1.0) < ridge), key=predicted, reverse=True)
    order = []
    while compute or memory:
        if compute:
            order.append(compute.pop(0))
        if memory:
            order.append(memory.pop(0))
    out = [[] for _ in range(lanes)]
    load = [0.0] * lanes
    for op in order:
        k = min(range(lanes), key=load.__getitem__)
        out[k].append(op)
        load[k] += predicted(op)
    return out


def _lane_setup():
    torch.set_num_threads(1)


def run_lanes(pool: ThreadPoolExecutor, lanes: list) -> None:
    """Run each lane's operators in order, the lanes in parallel (pool: one worker per lane,
    made with initializer=torch.set_num_threads(1) via ``lane_pool``)."""
    futures = [pool.submit(lambda ops=ops: [op() for op in ops]) for ops in lanes if ops]
    for f in futures:
        f.result()


def lane_pool(lanes: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="hkstore-lane", initializer=_lane_setup)
