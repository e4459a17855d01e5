"""The packer's per-token loss mask (a tool's output inside an agent response): an all-ones mask
gives bitwise today's log-probs, entropies and gradients in every layout and on the Hugging Face
path; masked tokens are exactly 0 with no gradient, and the others are unchanged."""
import pytest
import torch

from preftune.model import logps as L
from tests.conftest import flat_grads
from tests.model.test_logps import LAYOUTS, _batch

MASK_SEED = 5


def _lists(seed: int = 0):
    """The `_batch` rows as token lists, and a mask with zeros inside some completions."""
    p_ids, p_mask, c_ids, c_mask, _ = _batch(seed)
    prompts = [p[m.bool()].tolist() for p, m in zip(p_ids, p_mask)]
    comps = [c[m.bool()].tolist() for c, m in zip(c_ids, c_mask)]
    g = torch.Generator().manual_seed(MASK_SEED)
    masks = [(torch.rand(len(c), generator=g) > 0.4).long().tolist() if i % 2 else None for i, c in enumerate(comps)]
    return prompts, comps, masks


def _run(model, prompts, comps, masks, *, pack=True):
    model.zero_grad()
    lp, ent, mask = L.list_logps(model, prompts, comps, 0, torch.device("cpu"), with_entropy=True, pack=pack,
                                 masks=masks)
    (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
    return lp.detach(), ent.detach(), mask, flat_grads(model).clone()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_all_ones_mask_is_bitwise_no_mask(model, layout, monkeypatch):
    monkeypatch.setattr(L, "MASKED", LAYOUTS[layout])
    prompts, comps, _ = _lists()
    plain = _run(model, prompts, comps, None)
    ones = _run(model, prompts, comps, [[1] * len(c) for c in comps])
    for a, b in zip(plain, ones):
        assert torch.equal(a, b)


def test_an_all_ones_mask_is_bitwise_no_mask_on_the_module_path(hf_model):
    prompts, comps, _ = _lists(1)
    for a, b in zip(_run(hf_model, prompts, comps, None), _run(hf_model, prompts, comps, [[1] * len(c) for c in comps])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["own", "module"])
def test_masked_tokens_are_zero_without_gradient_and_the_rest_unchanged(model, hf_model, which):
    net = model if which == "own" else hf_model
    prompts, comps, masks = _lists(2)
    lp_all, ent_all, pad_mask, _ = _run(net, prompts, comps, None)
    lp, ent, mask, grads = _run(net, prompts, comps, masks)
    want = torch.zeros_like(pad_mask)  # (n, T) the masks written out by hand
    for i, (c, m) in enumerate(zip(comps, masks)):
        want[i, :len(c)] = torch.tensor(m if m is not None else [1] * len(c), dtype=torch.long)
    assert torch.equal(mask, want) and 0 < want.sum() < pad_mask.sum()
    keep = want.bool()
    assert (lp[~keep] == 0).all() and (ent[~keep] == 0).all()
    assert torch.equal(lp[keep], lp_all[keep]) and torch.equal(ent[keep], ent_all[keep])
    # the gradient is that of the unmasked tokens' weighted sum alone
    net.zero_grad()
    lp_ref, _, _ = L.list_logps(net, prompts, comps, 0, torch.device("cpu"))
    (lp_ref * torch.linspace(0.5, 1.5, lp_ref.numel()).view_as(lp_ref) * want).sum().backward()
    torch.testing.assert_close(grads, flat_grads(net), rtol=0, atol=1e-6)
