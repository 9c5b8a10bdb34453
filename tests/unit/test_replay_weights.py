import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reflow.trainer.loss import replay_sample_weights


@settings(max_examples=200, deadline=None)
@given(samples=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 500)), min_size=1, max_size=64),
       tau=st.one_of(st.just(0.0), st.floats(1e-6, 1.0)))
def test_normalised_weights_preserve_the_token_mass(samples, tau):
    uses = torch.tensor([u for u, _ in samples])
    n = torch.tensor([k for _, k in samples])
    w = replay_sample_weights(uses, n, tau)
    if (uses == 0).any() or tau > 0:
        # Σ w̃_j n_j = Σ n_j (paper §4.1).
        assert torch.isclose((w * n).sum(), n.sum().float(), rtol=1e-4)
        # Replayed samples weigh τ times an unused one.
        if (uses == 0).any() and (uses > 0).any():
            ratio = w[uses > 0][0] / w[uses == 0][0]
            assert torch.isclose(ratio, torch.tensor(tau), atol=1e-5)
    else:
        assert (w == 0).all()


def test_worked_example():
    # Two unused samples of 10 tokens, one replayed of 20, τ = 0.5:
    # w = [1, 1, 0.5], Z = (10 + 10 + 10) / 40 = 0.75, w̃ = [4/3, 4/3, 2/3].
    w = replay_sample_weights(torch.tensor([0, 0, 1]), torch.tensor([10, 10, 20]), 0.5)
    torch.testing.assert_close(w, torch.tensor([4 / 3, 4 / 3, 2 / 3]))
