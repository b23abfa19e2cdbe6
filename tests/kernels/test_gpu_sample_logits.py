"""``kernels.sample_logits`` on CUDA at a real vocabulary against the exact float64 scores
(``-m gpu``): the same rule as the exponential race's GPU test, rows with a clear winner
agree with the torch reference and every pick scores within 1e-5 of its row's best; greedy
rows keep the argmax handed in, and a row's draw does not depend on the batch."""

import pytest
import torch

from kernels import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_sample_logits_on_cuda(rows):
    from kernels.sample_logits import sample_logits_triton

    g = torch.Generator(device="cuda").manual_seed(rows)
    vocab = 151936
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    temp = torch.rand(rows, device="cuda", generator=g) + 0.3
    temp[::3] = 0.0  # greedy rows
    div = torch.where(temp > 0, temp, torch.ones_like(temp))
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=g)
    pos = torch.randint(0, 40000, (rows,), device="cuda", generator=g)
    greedy = torch.full((rows,), 5, dtype=torch.int64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sample_logits_triton(logits, div, temp, seeds, pos, greedy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = ref.sample_logits_reference(logits, div, temp, seeds, pos, greedy)
    probs = (logits.double() / div.double()[:, None]).softmax(-1)
    score = probs / -torch.log(ref.uniform_noise64(seeds, pos, vocab))
    top2 = score.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4 * top2[:, 0]
    sampled = temp > 0
    picked = score.gather(1, got[:, None])[:, 0]
    bad = (sampled & ((top2[:, 0] - picked) > 1e-5 * top2[:, 0])).nonzero().flatten().tolist()
    assert not bad, f"picks off the best on rows {bad}"
    assert torch.equal(got[clear | ~sampled], want[clear | ~sampled])
    assert (got[~sampled] == 5).all()
    for r in range(min(rows, 4)):
        s = slice(r, r + 1)
        assert sample_logits_triton(logits[s], div[s], temp[s], seeds[s], pos[s], greedy[s])[0] == got[r]
    for _ in range(20):  # the last-arriving slice picks, whatever order the slices finish in
        assert torch.equal(sample_logits_triton(logits, div, temp, seeds, pos, greedy), got)
    from kernels.attention_splits import arrival_counters

    assert int(arrival_counters(logits.device, 1, user="sampler").count_nonzero()) == 0  # all re-armed


@pytest.mark.parametrize("rows", [3, 40])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_table_options_and_commit_on_cuda(rows, pos_dtype):
    """The options read in place from an option table at shuffled device rows (``option_rows``)
    draw exactly what their gathered copies draw, and ``commit`` writes each token at its
    device row and position of the token table, nothing else."""
    from kernels.sample_logits import sample_logits_triton
    from workers.device_state import DIVISOR_WORD, OPTION_WORDS, SEED_WORD, TEMPERATURE_WORD

    g = torch.Generator(device="cuda").manual_seed(rows)
    vocab, table_rows = 151936, 64
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    temp = torch.rand(rows, device="cuda", generator=g) + 0.3
    temp[::3] = 0.0
    div = torch.where(temp > 0, temp, torch.ones_like(temp))
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=g)
    pos = torch.randint(0, 100, (rows,), device="cuda", generator=g)
    greedy = torch.full((rows,), 5, dtype=torch.int64, device="cuda")
    dev_rows = torch.randperm(table_rows, device="cuda", generator=g)[: -(-rows // 4) * 4]
    table = torch.zeros(OPTION_WORDS, table_rows, dtype=torch.int64, device="cuda")
    table[TEMPERATURE_WORD, dev_rows[:rows]] = temp.view(torch.int32).long()
    table[DIVISOR_WORD, dev_rows[:rows]] = div.view(torch.int32).long()
    table[SEED_WORD, dev_rows[:rows]] = seeds
    tokens = torch.full((table_rows, 100), -1, dtype=torch.int64, device="cuda")
    want = sample_logits_triton(logits, div, temp, seeds, pos, greedy)
    words = (table[DIVISOR_WORD], table[TEMPERATURE_WORD], table[SEED_WORD])
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sample_logits_triton(logits, *words, pos.to(pos_dtype), greedy, option_rows=dev_rows, commit=tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, want)
    expect = torch.full_like(tokens, -1)
    expect[dev_rows[:rows], pos] = want
    assert torch.equal(tokens, expect)
