"""GAD++ (hasten.approx.GADPlusPlus, lossy): a drafted token passes when it is among the
verifier's top-beta and within tau (log-probability) of the top one; the run ends at the first
that fails and the argmax follows. beta=1 is exact greedy verification."""
import pytest
import torch

from hasten.approx import GADPlusPlus
import hasten
from hasten.core.sampling import Sampling
from hasten.core.tree import TokenTree
from hasten.drafters.base import Draft, Drafter
from hasten.engine.verify import GreedyAcceptance
from helpers import ScriptedDrafter, hf_greedy, repetitive_prompt, tiny_model

GREEDY = Sampling(0.0)

# logits per block index over 5 tokens, worked by hand for beta=2, tau=1.0
LOGITS = torch.tensor([
    [0.0, 1.0, 3.0, 2.5, -1.0],  # top 2 (3.0); 3 is second, 0.5 below: passes
    [2.0, 1.9, 0.0, 0.0, 0.0],  # top 0; 1 is second, 0.1 below: passes
    [0.0, 0.0, 5.0, 4.5, 4.2],  # top 2; 4 is 0.8 below but third: fails (top-beta); the argmax 2 follows
    [0.0, 0.0, 0.0, 0.0, 1.0],
])


def test_the_rule_on_a_hand_worked_chain():
    chain = TokenTree.chain(3)
    verdict = GADPlusPlus(beta=2, tau=1.0).verify(chain, (3, 1, 4), LOGITS, None, GREEDY, None)
    assert (verdict.accepted, verdict.next_token) == ((0, 1), 2)
    # the same on log-probabilities: the rule compares differences, which log-softmax keeps
    assert GADPlusPlus(beta=2, tau=1.0).verify(chain, (3, 1, 4), LOGITS.log_softmax(-1), None, GREEDY, None) == verdict
    # exact greedy verification rejects the first token (3 is not the argmax 2)
    assert GreedyAcceptance().verify(chain, (3, 1, 4), LOGITS, None, GREEDY, None).accepted == ()


@pytest.mark.parametrize("beta, tau, passes", [
    (2, 1.0, {2, 3}),  # 3: second, 0.5 below
    (2, 0.4, {2}),  # 3 is 0.5 below: outside the tolerance
    (3, 2.5, {1, 2, 3}),  # 1: third, 2.0 below; 0 would be fourth
    (1, 9.0, {2}),  # beta=1: the argmax alone, whatever tau
])
def test_which_tokens_pass_on_one_row(beta, tau, passes):
    assert GADPlusPlus(beta=beta, tau=tau).passing(LOGITS[:1]) == [passes]


@pytest.mark.parametrize("seed", range(20))
def test_beta_1_tau_0_is_exact_greedy_verification(seed):
    g = torch.Generator().manual_seed(seed)
    vocab, n = 6, 7
    parents = [-1]
    for i in range(1, n):
        parents.append(int(torch.randint(-1, i, (1,), generator=g)))
    tree = TokenTree(tuple(parents))
    logits = torch.randint(0, 3, (n + 1, vocab), generator=g).float()  # ties at the top, often
    argmax = logits.argmax(-1)
    right = torch.rand(n, generator=g) < 0.7  # most nodes are the argmax after their parent
    tokens = tuple(int(argmax[p + 1]) if right[i] else int(torch.randint(vocab, (1,), generator=g))
                   for i, p in enumerate(parents))
    assert GADPlusPlus(beta=1, tau=0.0).verify(tree, tokens, logits, None, GREEDY, None) == \
        GreedyAcceptance().verify(tree, tokens, logits, None, GREEDY, None)


def test_in_the_loop_beta_1_is_plain_and_a_loose_rule_takes_wrong_drafts():
    model = tiny_model("t5")
    prompt = repetitive_prompt(16, seed=2)
    reference = hf_greedy(model, prompt, 12)[0].tolist()
    exact = hasten.generate(model, prompt, drafter=ScriptedDrafter(reference, 4, "adversarial"),
                            lossy_acceptance=GADPlusPlus(beta=1), max_new_tokens=12, draft_size="fixed")
    assert exact.sequences[0].tolist() == reference and exact.lossy == ("GADPlusPlus",)
    assert exact.stats.accepted_tokens == 0
    # everything passes: the (wrong) drafts are committed, so the output leaves plain decoding
    loose = GADPlusPlus(beta=96, tau=1e9)
    wrong = hasten.generate(model, prompt, drafter=Shifted(), lossy_acceptance=loose, max_new_tokens=12,
                            draft_size="fixed")
    assert wrong.sequences[0].tolist() != reference and wrong.stats.accepted_tokens > 0
    # it relaxes greedy decoding: a sampling request is refused, naming the rule
    with pytest.raises(ValueError, match="GADPlusPlus relaxes greedy decoding"):
        hasten.generate(model, prompt, drafter=Shifted(), lossy_acceptance=loose, max_new_tokens=4, temperature=1.0)


class Shifted(Drafter):
    """Drafts the root's id + 1, three times: wrong wherever the target does not repeat that."""

    name = "shifted"

    def __init__(self):
        pass

    def propose(self, ctx):
        return Draft.chain([(ctx.tokens[-1] + 1) % ctx.target.vocab_size] * min(3, ctx.max_depth))


def test_settings_and_sampling_are_checked():
    with pytest.raises(ValueError, match="beta"):
        GADPlusPlus(beta=0)
    with pytest.raises(ValueError, match="tau"):
        GADPlusPlus(tau=float("nan"))
    with pytest.raises(ValueError, match="temperature 0"):
        GADPlusPlus().verify(TokenTree.chain(1), (1,), LOGITS[:2], None, Sampling(1.0), None)
    assert not GADPlusPlus.lossless
