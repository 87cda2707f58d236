"""Benchmark of ``linear_logprobs`` (log-probs + entropy from hidden states and the LM
head, forward + backward) against the ways trainers compute them today.

CPU workload: N = 2048 tokens, H = 1024, V = 32768, fp32. GPU workload: N = 16384,
H = 4096, V = 151936 (Qwen's vocabulary), bf16. Every method computes the target
log-probs *and* the entropies, then backpropagates random per-token upstream gradients
of both into ``hidden`` and ``weight`` (leaves, ``.grad`` reset to None before each
call), as an actor update does.

Methods:
- fused: ``rlvr_kernels.linear_logprobs(..., return_entropy=True)``.
- fused_bf16: the same with ``logits_precision="bf16"`` (the logits of a bf16 LM head: operands
  and logits rounded to bf16; target: at most 1.15× fused's time).
- fused_support: the same restricted to an explicit sampling support, the CSR of the set a
  top-p 0.9 filter keeps on these logits (built before timing; target: at most 1.2× fused).
- fused_top_k / fused_top_p: the same with the support computed in the kernels, ``top_k=50``
  / ``top_p=0.9`` (target: at most 2× fused).
- eager: ``logits = hidden @ W.T``, ``log_softmax``, gather, ``−Σ p log p`` (materialised).
- trl: TRL's ``selective_log_softmax`` + ``entropy_from_logits`` on materialised logits.
- trl_chunked: TRL 1.16's own fused head, ``trl.kernels.ChunkedLogProbFunction`` (what its
  GRPOTrainer runs: ``outputs=("entropy",)``, its default vocabulary chunk of 32768; cuBLAS
  tiles and a Triton statistics kernel on CUDA, torch tiles on CPU).
- verl: verl's chunked torch path ``FusedLinearForPPO(chunk_size=512, impl_backend="torch")``.
- liger: Liger's ``LigerFusedLinearScaledCrossEntropyFunction`` (on CPU its chunked torch
  fallback; on sm_90 its CuTe kernel).
- GPU only: Apple CCE ``linear_cross_entropy`` (log-probs only: it has no entropy) and
  verl's Triton ``linear_cross_entropy``.

Time: median of interleaved rounds in this process (every method once per round, so a
load change on a shared machine hits all alike). Memory: each method once more in a fresh
subprocess; on CPU the peak RSS of the call above the RSS before it (VmHWM reset through
``/proc/self/clear_refs``, the heap's free pages given back first), on CUDA ``max_memory_allocated`` above the inputs.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from .. import linear_logprobs
from .advantages import _target
from .timing import in_fresh_processes, peak_extra_gb, time_fn

# Targets on CPU: time ≤ 1.1× eager and extra peak memory ≤ 0.2 GB.
CPU_TIME_TARGET = 1.1
CPU_MEMORY_TARGET_GB = 0.2
# logits_precision="bf16" against the default, on every device.
BF16_LOGITS_TIME_TARGET = 1.15
# Sampling supports against the default: an explicit one, and one computed in the kernels.
SUPPORT_TIME_TARGET = 1.2
COMPUTED_SUPPORT_TIME_TARGET = 2.0
# The explicit support of fused_support: what top-p with this value keeps.
SUPPORT_TOP_P = 0.9


def shape(device: str, quick: bool) -> Dict:
    if device == "cuda":
        return (
            dict(N=2048, H=1024, V=32768, dtype=torch.bfloat16)
            if quick
            else dict(N=16384, H=4096, V=151936, dtype=torch.bfloat16)
        )
    return (
        dict(N=256, H=256, V=8192, dtype=torch.float32) if quick else dict(N=2048, H=1024, V=32768, dtype=torch.float32)
    )


def make_inputs(device: str, quick: bool = False, seed: int = 0) -> Dict:
    s = shape(device, quick)
    gen = torch.Generator().manual_seed(seed)
    N, H, V, dt = s["N"], s["H"], s["V"], s["dtype"]
    # Hidden states of unit scale and an LM head scaled as at initialisation: logits of
    # std ~2, like a trained model's, so no method runs on degenerate rows.
    hidden = torch.randn(N, H, generator=gen).to(device=device, dtype=dt)
    weight = (2 * torch.randn(V, H, generator=gen) / H**0.5).to(device=device, dtype=dt)
    targets = torch.randint(0, V, (N,), generator=gen).to(device)
    g_logp = torch.randn(N, generator=gen).to(device)
    g_ent = torch.randn(N, generator=gen).to(device)
    return dict(
        s,
        hidden=hidden.requires_grad_(True),
        weight=weight.requires_grad_(True),
        targets=targets,
        g_logp=g_logp,
        g_ent=g_ent,
    )


def _eager(hidden, weight, targets):
    logp_all = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _trl(hidden, weight, targets):
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    logits = hidden @ weight.T
    return selective_log_softmax(logits, targets), entropy_from_logits(logits)


def _verl(hidden, weight, targets):
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    return FusedLinearForPPO(chunk_size=512, impl_backend="torch")(hidden, weight, targets)


def _liger(hidden, weight, targets):
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

    nll, entropy = LigerFusedLinearScaledCrossEntropyFunction.apply(hidden, weight, targets, 1.0, -100, 1, True)
    return -nll, entropy


def _cce(hidden, weight, targets):
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(hidden, weight, targets, reduction="none"), None


def _verl_kernel(hidden, weight, targets):
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, targets, 1.0, "none")


def _trl_chunked(hidden, weight, targets):
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    out = ChunkedLogProbFunction.apply(
        hidden, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("entropy",)
    )
    return out[0], out[1]


def _fused(hidden, weight, targets):
    out = linear_logprobs(hidden, weight, targets, return_entropy=True)
    return out.logp, out.entropy


def _fused_bf16(hidden, weight, targets):
    out = linear_logprobs(hidden, weight, targets, return_entropy=True, logits_precision="bf16")
    return out.logp, out.entropy


def _fused_support(hidden, weight, targets, support_ids, support_offsets):
    out = linear_logprobs(
        hidden, weight, targets, return_entropy=True, support_ids=support_ids, support_offsets=support_offsets
    )
    return out.logp, out.entropy


def _fused_top_k(hidden, weight, targets):
    out = linear_logprobs(hidden, weight, targets, return_entropy=True, top_k=50)
    return out.logp, out.entropy


def _fused_top_p(hidden, weight, targets):
    out = linear_logprobs(hidden, weight, targets, return_entropy=True, top_p=0.9)
    return out.logp, out.entropy


def top_p_support(x: Dict, top_p: float = SUPPORT_TOP_P, rows: int = 256) -> None:
    """Adds the CSR (``support_ids``, ``support_offsets``) of what top-p keeps on the inputs'
    logits to ``x``, a block of rows at a time (setup, not timed); each target is put inside
    its row's set, as a sampled token is."""
    from ..reference.logprobs import sampling_threshold

    hidden, weight, targets = x["hidden"].detach(), x["weight"].detach(), x["targets"]
    ids, counts = [], []
    for r0 in range(0, hidden.shape[0], rows):
        z = (hidden[r0 : r0 + rows] @ weight.T).float()
        n = z.shape[0]
        off = torch.zeros(n, dtype=torch.int64, device=z.device)
        kept = z >= sampling_threshold(z, off, torch.full_like(z[:, 0], top_p), torch.zeros_like(z[:, 0]))[:, None]
        kept[torch.arange(n, device=z.device), targets[r0 : r0 + rows]] = True
        row, col = kept.nonzero(as_tuple=True)
        ids.append(col)
        counts.append(kept.sum(-1))
    x["support_ids"] = torch.cat(ids)
    counts = torch.cat(counts)
    x["support_offsets"] = torch.cat([counts.new_zeros(1), counts.cumsum(0)])


METHODS = {
    "fused": ("rlvr_kernels.linear_logprobs (fused, tiled, recompute in backward)", _fused),
    "fused_bf16": ('rlvr_kernels.linear_logprobs, logits_precision="bf16" (a bf16 head\'s logits)', _fused_bf16),
    "fused_support": ("rlvr_kernels.linear_logprobs, explicit support (the CSR of a top-p 0.9 set)", _fused_support),
    "fused_top_k": ("rlvr_kernels.linear_logprobs, top_k=50 (support computed in the kernels)", _fused_top_k),
    "fused_top_p": ("rlvr_kernels.linear_logprobs, top_p=0.9 (support computed in the kernels)", _fused_top_p),
    "eager": ("eager torch: materialised logits, log_softmax, gather, -sum p log p", _eager),
    "trl": ("TRL selective_log_softmax + entropy_from_logits (materialised logits)", _trl),
    "trl_chunked": ("TRL trl.kernels.ChunkedLogProbFunction (TRL 1.16's fused chunked LM head)", _trl_chunked),
    "verl": ("verl FusedLinearForPPO (chunked torch, 512 tokens)", _verl),
    "liger": ("Liger LigerFusedLinearScaledCrossEntropyFunction", _liger),
    "cce": ("Apple CCE linear_cross_entropy (log-probs only, no entropy)", _cce),
    "verl_kernel": ("verl linear_cross_entropy (Triton kernel)", _verl_kernel),
}
SAMPLING_METHODS = ("fused_support", "fused_top_k", "fused_top_p")  # restricted distributions: not compared
CPU_METHODS = ("fused", "fused_bf16", *SAMPLING_METHODS, "eager", "trl", "trl_chunked", "verl", "liger")
GPU_METHODS = ("fused", "fused_bf16", *SAMPLING_METHODS, "eager", "liger", "cce", "verl_kernel", "trl", "trl_chunked")


def step_fn(key: str, x: Dict) -> Callable[[], Dict]:
    """One forward + backward of method ``key``; returns its outputs for the agreement check."""
    fn = METHODS[key][1]
    if key == "fused_support":
        if "support_ids" not in x:
            top_p_support(x)
        ids, offsets = x["support_ids"], x["support_offsets"]
        fn = lambda h, w, t: _fused_support(h, w, t, ids, offsets)  # noqa: E731

    def step():
        x["hidden"].grad = None
        x["weight"].grad = None
        logp, entropy = fn(x["hidden"], x["weight"], x["targets"])
        # (a target outside a sampling support has log-prob −inf and no gradient)
        loss = (torch.where(torch.isneginf(logp), 0.0, logp.float()) * x["g_logp"]).sum()
        if entropy is not None:
            loss = loss + (entropy.float() * x["g_ent"]).sum()
        loss.backward()
        return dict(logp=logp.detach(), entropy=None if entropy is None else entropy.detach())

    return step


def measure_memory(key: str, device: str, quick: bool) -> Dict:
    """Peak extra memory of one call of ``key`` (run in a fresh process by ``memory_rows``)."""
    x = make_inputs(device, quick)
    return {"extra_gb": peak_extra_gb(step_fn(key, x), device)}


def memory_rows(keys: List[str], device: str, quick: bool) -> Dict[str, Dict]:
    calls = [(key, device, quick) for key in keys]
    return dict(zip(keys, in_fresh_processes(__name__, "measure_memory", calls, quick)))


def matmul_tflops(device: str, dtype: torch.dtype, n: int = 8192) -> Optional[float]:
    """Measured dense matmul rate (the GPU table's FLOP fraction is relative to it)."""
    if device != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_fn(lambda: a @ b, device, repeats=10, warmup=3)
    return 2 * n**3 / (t["ms"] * 1e-3) / 1e12


def workload(device: str, quick: bool = False) -> Dict:
    x = make_inputs(device, quick)
    N, H, V = x["N"], x["H"], x["V"]
    keys = list(CPU_METHODS if device == "cpu" else GPU_METHODS)
    steps, outputs, errors = {}, {}, {}
    for key in keys:  # first call: warm-up, agreement, and whether the method runs here at all
        step = step_fn(key, x)
        try:
            outputs[key] = step()
            outputs[key]["grad_hidden"] = x["hidden"].grad.detach().clone()
            steps[key] = step
        except Exception as e:  # a peer that cannot run here is reported, not hidden
            errors[key] = repr(e)[:120]
    repeats = 3 if quick or device == "cpu" else 10
    times = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            times[key].append(time_fn(step, device, repeats=1, warmup=0)["ms"])
    memory = memory_rows(list(steps), device, quick)
    flops = 8 * N * H * V  # forward GEMM, its recompute and the two gradient GEMMs
    peak = matmul_tflops(device, x["dtype"])
    rows = {}
    for key in keys:
        r = {"method": METHODS[key][0], "key": key}
        if key in times:
            r["ms"] = sorted(times[key])[len(times[key]) // 2]
            r["extra_gb"] = memory.get(key, {}).get("extra_gb")
        else:
            r["ms"], r["note"] = None, errors.get(key)
        rows[key] = r
    fused = rows["fused"].get("ms")
    for r in rows.values():
        r["ratio"] = r["ms"] / fused if r.get("ms") and fused else None
        if r.get("ms") and peak:
            r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
            r["matmul_fraction"] = r["tflops"] / peak
    ref = outputs.get("fused")
    agreement = {}
    for key, out in outputs.items():
        if key == "fused" or ref is None or key in SAMPLING_METHODS:
            continue
        agreement[key] = {
            "logp": float((out["logp"].float() - ref["logp"].float()).abs().max()),
            "grad_hidden": float((out["grad_hidden"].float() - ref["grad_hidden"].float()).abs().max()),
        }
    targets = []
    if device == "cpu":
        targets.append(_target("fused / eager torch time", rows, "fused", "eager", "<=", CPU_TIME_TARGET))
        gb = rows["fused"].get("extra_gb")
        targets.append(
            {
                "target": f"fused extra peak memory (GB) <= {CPU_MEMORY_TARGET_GB}",
                "measured": gb,
                "met": None if gb is None else gb <= CPU_MEMORY_TARGET_GB,
            }
        )
    targets.append(_target("fused_bf16 / fused time", rows, "fused_bf16", "fused", "<=", BF16_LOGITS_TIME_TARGET))
    targets.append(_target("fused_support / fused time", rows, "fused_support", "fused", "<=", SUPPORT_TIME_TARGET))
    for key in ("fused_top_k", "fused_top_p"):
        targets.append(_target(f"{key} / fused time", rows, key, "fused", "<=", COMPUTED_SUPPORT_TIME_TARGET))
    if device == "cpu":
        for key in SAMPLING_METHODS:
            gb = rows[key].get("extra_gb")
            targets.append(
                {
                    "target": f"{key} extra peak memory (GB) <= {CPU_MEMORY_TARGET_GB}",
                    "measured": gb,
                    "met": None if gb is None else gb <= CPU_MEMORY_TARGET_GB,
                }
            )
    # The bar against TRL's own fused head: no slower, and less peak memory.
    targets.append(_target("fused / TRL ChunkedLogProbFunction time", rows, "fused", "trl_chunked", "<=", 1.0))
    gb, gb_trl = rows["fused"].get("extra_gb"), rows.get("trl_chunked", {}).get("extra_gb")
    targets.append(
        {
            "target": "fused extra peak memory / TRL ChunkedLogProbFunction's < 1",
            "measured": None if gb is None or not gb_trl else gb / gb_trl,
            "met": None if gb is None or gb_trl is None else gb < gb_trl,
        }
    )
    for key in keys:
        if key not in ("fused", "fused_bf16", *SAMPLING_METHODS) and rows[key].get("ms"):
            targets.append(_target(f"{key} / fused time", rows, key, "fused", "info", None))
    mem_kind = (
        "peak RSS above the RSS before the call (free heap pages returned first)"
        if device == "cpu"
        else "max_memory_allocated above inputs"
    )
    notes = [
        f"N={N} tokens, H={H}, V={V}, {str(x['dtype']).replace('torch.', '')}; log-probs + entropy, forward + "
        f"backward into hidden and weight with random upstream gradients; {repeats} interleaved rounds (median)",
        f"extra memory: each method once in a fresh process, {mem_kind}; the gradients of hidden and weight "
        f"alone are {(N * H + V * H) * x['hidden'].element_size() / 1e9:.2f} GB",
        f"fused_support: {x['support_ids'].shape[0] / N:.0f} kept ids per row on average"
        if "support_ids" in x
        else "fused_support did not run",
        "agreement with fused (max abs diff of log-probs / grad hidden): "
        + ", ".join(f"{k} {v['logp']:.1e} / {v['grad_hidden']:.1e}" for k, v in agreement.items()),
    ]
    if peak:
        notes.append(
            f"FLOP rate: 8*N*H*V = {flops / 1e12:.2f} TFLOP per call (4 GEMM-equivalents) over a measured "
            f"{str(x['dtype']).replace('torch.', '')} matmul rate of {peak:.0f} TFLOP/s"
        )
    for key, why in errors.items():
        notes.append(f"{key} did not run here: {why}")
    kind = "quick" if quick else "standard"
    return {
        "name": f"{kind} workload: N={N}, H={H}, V={V}, {str(x['dtype']).replace('torch.', '')}; "
        "log-probs + entropy, forward + backward",
        "rows": list(rows.values()),
        "targets": targets,
        "agreement": agreement,
        "notes": notes,
    }


WORKLOADS: Dict[str, Callable] = {"lm_head_logprobs_entropy": workload}
