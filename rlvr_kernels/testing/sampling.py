"""The rollout engines' sampling filters as the engines compute them (sort-based), to test the
sampling support of ``linear_logprobs`` / ``logprobs_from_logits`` against: what each engine
keeps, formula for formula, ties split by its sort.

- vLLM (``vllm/v1/sample/sampler.py``, ``Sampler.sample``): temperature, then the argmax-invariant
  logits processors (min-p: ``vllm/v1/sample/logits_processor/builtin.py``, ``MinPLogitsProcessor``),
  then ``apply_top_k_top_p`` (``vllm/v1/sample/ops/topk_topp_sampler.py``): top-k as a value
  threshold, top-p on an ascending sort of the top-k survivors' softmax, masked where the
  cumulative sum is <= 1 − p, the largest always kept.
- SGLang (``python/sglang/srt/layers/sampler.py``, ``top_k_top_p_min_p_sampling_from_probs_torch``):
  one descending sort of the full softmax; positions >= k dropped, then those whose exclusive
  cumulative sum exceeds p, then those below min_p times the largest.
"""

from __future__ import annotations

import torch


def _rows(x, n: int, dtype, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype).reshape(-1).expand(n).clone()
    return torch.full((n,), x, dtype=dtype, device=device)


def vllm_kept(z: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """[N, V] bool: the columns vLLM's sampler keeps for temperature-scaled logits z [N, V]
    (``top_k`` <= 0 or None, ``top_p`` None or 1, ``min_p`` None or 0: that filter off)."""
    n, v = z.shape
    logits = z.clone()
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * _rows(min_p, n, z.dtype, z.device)[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    k = None if top_k is None else _rows(top_k, n, torch.int64, z.device)
    if k is not None:
        k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)  # vLLM's "no top-k" is k = V
    p = None if top_p is None else _rows(top_p, n, z.dtype, z.device)
    if p is None and k is not None:
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        kth = torch.where((k == v)[:, None], torch.full_like(kth, float("-inf")), kth)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    elif p is not None:
        logits_sort, idx = logits.sort(dim=-1, descending=False)
        if k is not None:
            kth = logits_sort.gather(1, (v - k)[:, None])
            logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
        probs_sum = torch.cumsum(logits_sort.softmax(dim=-1), dim=-1)
        drop = probs_sum <= 1 - p[:, None]
        drop[:, -1] = False
        logits_sort = logits_sort.masked_fill(drop, float("-inf"))
        logits = logits_sort.scatter(dim=-1, index=idx, src=logits_sort)
    return torch.isfinite(logits) | (logits == float("inf"))


def sglang_kept(z: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """[N, V] bool: the columns SGLang's torch sampler keeps for temperature-scaled logits z."""
    n, v = z.shape
    probs = torch.softmax(z, dim=-1)
    k = _rows(v if top_k is None else top_k, n, torch.int64, z.device)
    k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
    p = _rows(1.0 if top_p is None else top_p, n, z.dtype, z.device)
    probs_sort, idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    keep = torch.arange(v, device=z.device)[None, :] < k[:, None]
    keep &= (probs_sum - probs_sort) <= p[:, None]
    if min_p is not None:
        keep &= probs_sort >= probs_sort[:, :1] * _rows(min_p, n, z.dtype, z.device)[:, None]
    return torch.zeros_like(keep).scatter(1, idx, keep)


def tie_closure(z: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The kept set with every tie class of its least value kept whole: {z >= min kept z}, the
    value-based set a threshold keeps (an engine's sort may split a tie at the boundary)."""
    least = torch.where(kept, z, torch.full_like(z, float("inf"))).amin(-1, keepdim=True)
    return z >= least
