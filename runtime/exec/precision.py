"""Which precision the CPU executor's rows run in: fp32, or bf16 with fp32 accumulation.

A bf16 row runs oneDNN's GEMM on weights packed once in bf16 (runtime.exec.onednn); the residual
stream and LayerNorm stay fp32. ``fp32`` and ``bf16`` set every row; ``auto`` runs each row at
the precision its PET's meta records (``"precision"``, chosen by measurement when the tenant was
made or profiled; none recorded: fp32), and rows of both precisions share a batch. bf16 pays only
where the CPU multiplies bf16 natively (AVX512_BF16, or AMX-BF16 tiles): elsewhere oneDNN emulates
it, slower than fp32, so bf16 is refused there and ``auto`` runs every row fp32.
"""

from __future__ import annotations

import functools
import logging

import torch

PRECISIONS = ("fp32", "bf16", "auto")
NATIVE_FLAGS = ("amx_bf16", "avx512_bf16")  # the faster first: oneDNN takes AMX tiles where there are any

log = logging.getLogger("runtime.exec.precision")


class PrecisionUnavailable(ValueError):
    """A precision this machine cannot run at full speed was asked for."""


def cpu_flags() -> set:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def bf16_native() -> str | None:
    """The native bf16 instruction set this CPU and torch offer ("amx_bf16", "avx512_bf16"), or None."""
    from runtime.exec import onednn

    if not onednn.available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    flags = cpu_flags()
    return next((f for f in NATIVE_FLAGS if f in flags), None)


def resolve(precision: str) -> str:
    """fp32 or bf16 for a requested precision: bf16 where the CPU lacks native bf16 raises
    PrecisionUnavailable; auto is bf16 where it has it (rows may run it), else fp32 (said once
    in the log)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return "fp32"
    native = bf16_native()
    if native is not None:
        return "bf16"
    if precision == "bf16":
        raise PrecisionUnavailable(
            "precision 'bf16' needs a CPU with AVX512_BF16 or AMX-BF16 and a torch with oneDNN; "
            "this machine has neither (oneDNN would emulate bf16, slower than fp32): use precision 'fp32'")
    _say_fp32_once()
    return "fp32"


def mode(precision: str) -> str:
    """What rows run at for a requested precision: "fp32", "bf16" (every row) or "auto" (each row
    at its record, row_bf16); auto is fp32 where the CPU lacks native bf16, bf16 there refused."""
    resolved = resolve(precision)
    return "auto" if precision == "auto" and resolved == "bf16" else resolved


@functools.cache
def _say_fp32_once():
    log.warning("precision auto: this CPU has no AVX512_BF16 / AMX-BF16, every row runs fp32")


def row_bf16(meta: dict) -> bool:
    """Whether a PET's rows run bf16 under auto: its meta records "bf16" (anything else, or no
    record, is fp32)."""
    return meta.get("precision") == "bf16"


@functools.cache
def shared_bf16():
    """The process's one bf16 packer (runtime.exec.onednn.PackedLinears): executors share the
    base model's weights, so each is packed once."""
    from runtime.exec import onednn

    return onednn.PackedLinears(torch.bfloat16)
