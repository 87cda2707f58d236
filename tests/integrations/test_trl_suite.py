"""TRL's own test cases for the log-prob utilities, run against our drop-ins.

Ported from huggingface/trl (Apache-2.0, © The HuggingFace Team), the tests of the
functions ``rlvr_kernels.integrations.trl`` replaces:

* ``tests/test_utils.py``: ``TestSelectiveLogSoftmax`` (one and K ids per position, four
  dtypes) and ``TestEntropyFromLogits`` (four shapes, two chunk sizes, four dtypes);
* ``tests/test_kernels.py``: ``TestLogProbEntropy`` (forward and backward of
  ``selective_log_softmax_and_entropy`` through sliced, non-contiguous logits with
  logits ±20 apart, a target in the last partial block, a row mask, an output modified in
  place before the backward; and ``torch.compile``).

Each case keeps TRL's inputs and assertions, with the drop-in substituted, on every fast
backend (``use_backend``) and seeded. Two kinds of assertion are adapted, and say so:

* TRL asserts that its fp16/bf16 results *equal* a naive half-precision
  ``log_softmax`` (its torch fallback computes in that dtype). The drop-ins compute in
  fp32 and round once, which is more accurate and so not bit-equal; they are held to the
  project's rule instead: |ours − fp64 truth| ≤ 2·|TRL's expected − fp64 truth| + atol.
* ``TestLogProbEntropy`` runs TRL's Triton kernel on an accelerator, whose outputs are
  fp32. Where TRL's kernel does not run (here, CPU tensors), TRL's torch path returns the
  logits' dtype and so does the drop-in; the fp16/bf16 cases then use the same rule,
  with TRL's function on the same inputs as the same-dtype baseline. fp32 keeps TRL's
  tolerances.
"""

from __future__ import annotations

import pytest
import torch
import trl.trainer.utils as trl_utils
from _backends import FAST

from rlvr_kernels.integrations import trl as ours
from rlvr_kernels.testing import compare

HALF = (torch.float16, torch.bfloat16)


def within_rule(name, mine, expected, truth, dtype):
    """The project's tolerance rule (rlvr_kernels.testing.compare) for a half-precision case."""
    assert mine.dtype == expected.dtype, f"{name}: dtype {mine.dtype} != TRL's {expected.dtype}"
    c = compare(name, mine, truth, expected, dtype)
    assert c.ok, c


# ---------------------------------------------------------------------------------------
# tests/test_utils.py :: TestSelectiveLogSoftmax
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_selective_log_softmax(backend, device, dtype):
    """Test selective_log_softmax with logits of different dtypes"""
    vocab_size = 1024
    batch_size = 4
    seq_len = 32

    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(low=0, high=vocab_size, size=(batch_size, seq_len), generator=gen).to(device)
    logits = torch.randn(batch_size, seq_len, vocab_size, generator=gen).to(dtype).to(device)

    expected_output = torch.gather(logits.log_softmax(-1), dim=-1, index=input_ids.unsqueeze(-1)).squeeze(-1)
    with ours.use_backend(backend):
        actual_output = ours.selective_log_softmax(logits, input_ids)

    if dtype in HALF:
        # TRL: "half-precision dtypes fall back to an exact method" -> torch.equal (adapted: see the module docstring)
        truth = torch.gather(logits.double().log_softmax(-1), dim=-1, index=input_ids.unsqueeze(-1)).squeeze(-1)
        within_rule("logp", actual_output, expected_output, truth, dtype)
    else:
        torch.testing.assert_close(actual_output, expected_output, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 8])
def test_selective_log_softmax_multi_index(backend, device, dtype, k):
    """Test selective_log_softmax with logits of different dtypes and index widths"""
    vocab_size = 1024
    batch_size = 4
    seq_len = 32

    gen = torch.Generator().manual_seed(k)
    index = torch.randint(low=0, high=vocab_size, size=(batch_size, seq_len, k), generator=gen).to(device)
    logits = torch.randn(batch_size, seq_len, vocab_size, generator=gen).to(dtype).to(device)

    expected_output = torch.gather(logits.log_softmax(-1), dim=-1, index=index)
    with ours.use_backend(backend):
        actual_output = ours.selective_log_softmax(logits, index)

    assert actual_output.shape == (batch_size, seq_len, k)
    if dtype in HALF:
        truth = torch.gather(logits.double().log_softmax(-1), dim=-1, index=index)
        within_rule("logp", actual_output, expected_output, truth, dtype)
    else:
        torch.testing.assert_close(actual_output, expected_output, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# tests/test_utils.py :: TestEntropyFromLogits
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("shape", [(768,), (32, 768), (8, 16, 768), (2, 4, 8, 768)])
@pytest.mark.parametrize("chunk_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_entropy_from_logits_2_dims(backend, device, dtype, chunk_size, shape):
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype).to(device)
    if dtype in (torch.float64, torch.float32):
        p = logits.softmax(-1)
        entropy = -torch.sum(p * p.log(), dim=-1)
    else:
        logps = logits.log_softmax(dim=-1)
        entropy = -(torch.exp(logps) * logps).sum(-1)
    with ours.use_backend(backend):
        predicted_entropy = ours.entropy_from_logits(logits, chunk_size=chunk_size)
    if dtype in HALF:
        # TRL compares with rtol = atol = 1e-5 against a reference computed in half precision,
        # which its own half-precision code meets by computing the same way (adapted: see the
        # module docstring).
        p64 = logits.double().softmax(-1)
        within_rule("entropy", predicted_entropy, entropy, -(p64 * p64.log()).sum(-1), dtype)
    else:
        torch.testing.assert_close(predicted_entropy, entropy, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# tests/test_kernels.py :: TestLogProbEntropy
# ---------------------------------------------------------------------------------------


def reference(logits, index, temperature, row_mask):
    logits = logits.float() / temperature
    logprobs = logits.log_softmax(-1)
    selected_logprobs = logprobs.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    if row_mask is not None:
        selected_logprobs = selected_logprobs.masked_fill(~row_mask, 0.0)
        entropy = entropy.masked_fill(~row_mask, 0.0)
    return selected_logprobs, entropy


def _forward_backward(fn, base_logits, index, temperature, row_mask, logprob_weight, entropy_weight):
    """TRL's test body for one function: outputs (after TRL's in-place edit) and the gradient."""
    base = base_logits.detach().clone().requires_grad_()
    logprobs, entropy = fn(base[:, 1:4], index, temperature=temperature, row_mask=row_mask)
    # Mutating exposed outputs must not corrupt the private statistics saved for backward.
    logprobs[0, 2] = 0.0
    loss = 0.0
    if logprob_weight is not None:
        loss = loss + logprob_weight * logprobs.sum()
    if entropy_weight is not None:
        loss = loss + entropy_weight * entropy.sum()
    loss.backward()
    return logprobs.detach(), entropy.detach(), base.grad.clone()


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("logprob_weight", "entropy_weight", "use_mask"),
    [(2, None, True), (None, 0.5, True), (2, 0.5, True), (2, 0.5, False)],
)
def test_forward_and_backward(backend, device, dtype, logprob_weight, entropy_weight, use_mask):
    gen = torch.Generator().manual_seed(7)
    # Cross two full Triton blocks and leave a partial final block.
    vocab_size = 2053
    base_logits = torch.randn(2, 5, vocab_size, generator=gen).to(dtype).to(device)
    base_logits[..., :1024].add_(20)
    # Exercise online normalization across blocks with sharply different maxima.
    base_logits[..., 1024:2048].sub_(20)
    # TRL slices sequence logits and token IDs without making them contiguous.
    index = torch.randint(vocab_size, (2, 5), generator=gen).to(device)[:, 1:4]
    index[0, 0] = vocab_size - 1  # select a target from the partial block
    temperature = 0.7
    # Slice the mask too, matching the non-contiguous views passed by TRL.
    sliced_mask = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 1, 1, 1]], device=device, dtype=torch.bool)[:, 1:4]
    row_mask = sliced_mask if use_mask else None
    weights = (logprob_weight, entropy_weight)

    with ours.use_backend(backend):
        mine = _forward_backward(
            ours.selective_log_softmax_and_entropy, base_logits, index, temperature, row_mask, *weights
        )

    def reference_fn(logits, index, temperature, row_mask):
        return reference(logits, index, temperature, row_mask)

    ref = _forward_backward(reference_fn, base_logits, index, temperature, row_mask, *weights)
    if dtype == torch.float32:
        torch.testing.assert_close(mine[0], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine[1], ref[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine[2], ref[2], rtol=1e-3, atol=1e-3)
        return
    # Half precision on a device where TRL's kernel does not run: TRL's torch path (the
    # logits' dtype) is the same-dtype baseline, TRL's reference in fp64 the truth.
    trl = _forward_backward(
        trl_utils.selective_log_softmax_and_entropy, base_logits, index, temperature, row_mask, *weights
    )
    truth = _forward_backward(reference_fn, base_logits.double(), index, temperature, row_mask, *weights)
    assert mine[0].dtype == mine[1].dtype == trl[0].dtype == dtype
    for name, m, t, x in zip(("logprobs", "entropy", "grad"), mine, trl, truth):
        within_rule(name, m, t, x, dtype)


@pytest.mark.parametrize("backend,device", FAST)
def test_torch_compile(backend, device):
    """TRL's ``test_torch_compile_fullgraph``: the drop-in, with the ``use_backend`` setting it
    reads, compiles to one graph. Gradient finite and zero on masked rows, as TRL's; values
    as eager."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 3, 257, generator=gen).to(torch.bfloat16).to(device).requires_grad_(True)
    index = torch.randint(257, (2, 3), generator=gen).to(device)
    row_mask = torch.tensor([[1, 0, 1], [0, 1, 1]], device=device, dtype=torch.bool)

    def loss(logits, index, row_mask):
        logprobs, entropy = ours.selective_log_softmax_and_entropy(logits, index, temperature=0.8, row_mask=row_mask)
        return (logprobs + 0.1 * entropy).sum()

    torch._dynamo.reset()
    with ours.use_backend(backend):
        compiled = torch.compile(loss, fullgraph=True)(logits, index, row_mask)
        compiled.backward()
        grad = logits.grad.clone()
        logits.grad = None
        eager = loss(logits, index, row_mask)
        eager.backward()

    assert logits.grad is not None
    assert torch.isfinite(grad).all()
    assert torch.count_nonzero(grad[~row_mask]) == 0
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(grad, logits.grad)
