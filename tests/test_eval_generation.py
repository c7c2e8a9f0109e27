"""Batched KV-cache decoding and log-likelihood scoring on the tiny preset (float64, so batched
and one-at-a-time arithmetic cannot flip an argmax)."""
import pytest
import torch
import torch.nn.functional as F

from eval.generation import SamplingSettings, generate, naive_generate
from eval.likelihood import loglikelihoods, windows_nll

PROMPTS = ["def add(a, b):", "Hello world", "x", "The quick brown fox jumps over the lazy dog again and",
           "import os\n", "1 2 3"]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ds_twocircuit.models.presets import resolve_model
    folder = resolve_model("tiny")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # sharper, more varied outputs than the near-uniform random init
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model, tok


def test_batched_greedy_equals_one_at_a_time_and_hf_generate(tiny):
    model, tok = tiny
    s = SamplingSettings(max_new_tokens=24)
    batched = generate(model, tok, PROMPTS, s, batch_size=4, progress=False)
    single = generate(model, tok, PROMPTS, s, batch_size=1, progress=False)
    assert [b.text for b in batched] == [x.text for x in single]
    assert len({b.text for b in batched}) > 2  # the outputs really differ between prompts
    hf = naive_generate(model, tok, PROMPTS, 24, progress=False)
    for b, ids in zip(batched, hf):
        if b.finish == "length":
            assert tok.decode(ids) == b.text
        else:  # stopped at end-of-text: HF continues with padding
            assert tok.decode(ids, skip_special_tokens=True).startswith(b.text)


def test_stop_strings_and_patterns_cut_the_text(tiny):
    model, tok = tiny
    s = SamplingSettings(max_new_tokens=24)
    full = generate(model, tok, PROMPTS, s, batch_size=3, progress=False)
    for prompt, g in zip(PROMPTS, full):
        if len(g.text) < 6:
            continue
        stop = g.text[3:5]
        cut = generate(model, tok, [prompt], s, stop=[stop], progress=False)[0]
        assert cut.finish == "stop"
        assert cut.text == g.text[:g.text.find(stop)]
        assert cut.new_tokens < g.new_tokens
        pat = generate(model, tok, [prompt], s, stop_regex=".{4}", progress=False)[0]
        assert pat.finish == "stop" and len(pat.text) == 4


def test_max_new_tokens_and_eos(tiny):
    model, tok = tiny
    out = generate(model, tok, PROMPTS[:2], SamplingSettings(max_new_tokens=5), progress=False)
    assert all(g.new_tokens <= 5 for g in out)
    # make the end-of-text token the only choice after the prompt: finish "eos", empty text
    eos = tok.eos_token_id
    with torch.no_grad():
        saved = model.lm_head.weight.clone()
        bias = torch.zeros(model.config.vocab_size, dtype=torch.float64)
        bias[eos] = 1e4
        hook = model.lm_head.register_forward_hook(lambda m, i, o: o + bias)
        try:
            g = generate(model, tok, ["abc"], SamplingSettings(max_new_tokens=5), progress=False)[0]
        finally:
            hook.remove()
        assert torch.equal(model.lm_head.weight, saved)
    assert g.finish == "eos" and g.text == "" and g.new_tokens == 1


def test_sampling_is_reproducible(tiny):
    model, tok = tiny
    s = SamplingSettings(max_new_tokens=16, do_sample=True, temperature=1.0, top_p=0.9, seed=7)
    a = generate(model, tok, PROMPTS, s, batch_size=3, progress=False)
    b = generate(model, tok, PROMPTS, s, batch_size=3, progress=False)
    c = generate(model, tok, PROMPTS, SamplingSettings(16, True, 1.0, 0.9, seed=8), batch_size=3, progress=False)
    assert [x.text for x in a] == [x.text for x in b]
    assert [x.text for x in a] != [x.text for x in c]


def test_loglikelihoods_match_direct_computation(tiny):
    model, tok = tiny
    reqs = [(tok("Question: 2+2=")["input_ids"], tok(" 4")["input_ids"]),
            (tok("abc")["input_ids"], tok("defgh")["input_ids"]),
            (tok("a much longer context than the others, to force padding")["input_ids"], tok(" yes")["input_ids"])]
    got = loglikelihoods(model, reqs, batch_size=2, progress=False)
    for (ctx, cont), (score, n, greedy) in zip(reqs, got):
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = F.log_softmax(model(ids).logits[0, :-1], dim=-1)
        tgt = ids[0, 1:]
        want = logp[len(ctx) - 1:].gather(-1, tgt[len(ctx) - 1:, None]).sum()
        assert n == len(cont)
        assert score == pytest.approx(float(want), abs=1e-9)
        assert greedy == bool((logp[len(ctx) - 1:].argmax(-1) == tgt[len(ctx) - 1:]).all())


def test_windows_nll_matches_direct_cross_entropy(tiny):
    model, tok = tiny
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 256, (5, 40), generator=g)
    total, count = windows_nll(model, windows, batch_size=2, chunk=16, progress=False)
    assert count == 5 * 39
    with torch.no_grad():
        want = sum(float(F.cross_entropy(model(w[None]).logits[0, :-1], w[1:], reduction="sum"))
                   for w in windows)
        hf = sum(float(model(w[None], labels=w[None]).loss) * 39 for w in windows)  # float32 loss
    assert total == pytest.approx(want, rel=1e-12)
    assert total == pytest.approx(hf, rel=1e-6)


def test_rows_joining_a_running_batch_decode_like_single_rows(tiny, monkeypatch):
    """Stop strings end rows at different steps; waiting prompts join the running batch with
    left-padded cache rows and the common padding is trimmed: same text as batch size 1."""
    import eval.generation as G
    model, tok = tiny
    merges = []
    real_merge = G._merge
    monkeypatch.setattr(G, "_merge", lambda *a: merges.append(1) or real_merge(*a))
    prompts = [p + str(i) for i in range(4) for p in PROMPTS]  # 24 prompts of varied length
    s = SamplingSettings(max_new_tokens=20)
    stop = ["?", "W", "\x1b", "f"]  # frequent in its outputs: rows finish at different steps
    batched = generate(model, tok, prompts, s, stop=stop, batch_size=6, progress=False)
    single = generate(model, tok, prompts, s, stop=stop, batch_size=1, progress=False)
    assert [b.text for b in batched] == [x.text for x in single]
    assert [b.finish for b in batched] == [x.finish for x in single]
    assert len({b.new_tokens for b in batched}) >= 3
    assert len(merges) >= 2  # prompts really joined running batches
