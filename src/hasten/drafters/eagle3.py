"""EAGLE-3 (Li et al. 2025) in hasten's loop, and ``hasten train eagle3``.

The layer (:mod:`.eagle3_layer`) reads three of the target's layers, where hasten's loop
keeps only the last one (``ctx.features``). :class:`LayerTaps` keeps, for the target's latest
forwards, the residual stream entering the ``aux_layers`` and the last hidden state of every
row: forward hooks on the model's own forward, and a tap the lean forward calls (models/lean.py),
so EAGLE-3 runs on the lean and packed forwards like the other feature drafters. A committed feature row of ``ctx.features`` is a
copy of one such last-hidden row (prefill or accepted draft node), so its three-layer
features are found by matching it exactly; the hooks change nothing the target computes.
Rows that cannot be found (the prompt of the first generation, whose prefill ran before the
drafter met the target, or a forward older than the taps keep) are recomputed by one
forward of the target over the committed tokens, outside the loop's cache.

Drafting is a **chain**, as vLLM drafts EAGLE-3 (``num_speculative_tokens``): from the
newest committed pair ``(aux_{r-1}, x_r)``, the layer's pre-norm output and the guessed
token are fed back ``depth - 1`` times, greedily (argmax of the draft vocabulary), so
hasten's per-position acceptance and vLLM's measure the same drafts. Drafts are
deterministic (``probs=None``): the verifier keeps sampling exact.

Training (``hasten train eagle3``): the EAGLE-3 paper's training-time test. Step 0 reads
``fc(aux_t)`` and ``embed(x_{t+1})`` for every t of a distilled sequence (causal); step j
reads step j-1's own outputs and ``embed(x_{t+1+j})`` at position ``t + j`` and attends to
step 0's keys up to t and to its own chain's keys of steps 1..j (what drafting depth j+1
sees). Each step is scored by cross-entropy against the target's greedy next token
(mapped into the draft vocabulary), weighted ``decay ** j``. The draft vocabulary is the
``draft_vocab`` most frequent tokens of the target's own answers in the training rows.
"""
from __future__ import annotations

from collections import deque
from itertools import chain
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..core.settings import Settings, option
from ..core.stats import allocated_bytes
from ..models import lean
from ..models.layers import decoder_layers, num_layers
from .base import Draft, DraftContext, EMPTY_DRAFT, StepResult, register
from .eagle3_layer import Eagle3Layer, default_aux_layers
from .nn import CommittedRun, causal
from .trainable import Batch, TrainedTraining, rank_hits, valid_positions
from .trained import TrainedDrafter, WeightsSetting, at_least_one

KEPT_FORWARDS = 16  # forwards of the target whose taps are kept (a batch step is one forward)


# ---- the target's low/mid/high features -------------------------------------------------------------
class MissingFeatures(LookupError):
    """A committed row's three-layer features are no longer among the tapped forwards."""


class Eagle3Run(CommittedRun):
    """A generation's EAGLE-3 layer state, and the features of committed rows it has not run
    yet, kept past the taps' window (records as :class:`LayerTaps` keeps them, the newest last)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        self.kept_to = 0  # committed rows up to here are kept (or run by the layer)


class LayerTaps(lean.LayerTap):
    """For each of ``model``'s latest forwards, the last hidden state and the residual stream
    entering each of ``layers`` (concatenated), every row flattened: forward hooks on the model's
    own forward, and the same records from the lean forward (models/lean.py), which calls this
    tap itself (its hooks are marked as mirrored, so they leave the lean forward on)."""

    def __init__(self, model: PreTrainedModel, layers: tuple[int, ...]):
        self.records: deque[tuple[torch.Tensor, torch.Tensor, dict]] = deque(maxlen=KEPT_FORWARDS)
        self.layers = tuple(layers)
        self._inputs: dict[int, torch.Tensor] = {}
        self._model = model
        blocks = decoder_layers(model)

        def tap(layer: int):
            def hook(module, args, kwargs):
                self.layer_input(layer, args[0] if args else kwargs["hidden_states"])  # [B, T, H]
            setattr(hook, lean.MIRRORED, True)
            return hook

        def close(module, args, output):
            last = output[0] if isinstance(output, tuple) else output.last_hidden_state  # [B, T, H]
            self._record(last, None)

        setattr(close, lean.MIRRORED, True)
        self.handles = [blocks[k].register_forward_pre_hook(tap(k), with_kwargs=True) for k in set(layers)]
        self.handles.append(model.base_model.register_forward_hook(close))
        lean.add_tap(model, self)

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        self._inputs[layer] = x

    def close(self, states: torch.Tensor, keep: torch.Tensor | None) -> None:
        self._record(states, keep)

    def _record(self, last: torch.Tensor, keep: torch.Tensor | None) -> None:
        """``last`` [..., H]: a forward's last-layer states, at the rows ``keep`` of its layers' inputs."""
        inputs = {k: x.reshape(-1, x.shape[-1]) for k, x in self._inputs.items()}  # [N, H] each
        if keep is not None:
            inputs = {k: x.index_select(0, keep) for k, x in inputs.items()}
        last = last.reshape(-1, last.shape[-1])
        # a forward whose layers saw other rows than it returns (another drafter's riders
        # join mid-way) is not one the committed rows can come from: not recorded
        if len(inputs) == len(set(self.layers)) and all(x.shape[0] == last.shape[0] for x in inputs.values()):
            aux = torch.cat([inputs[k] for k in self.layers], -1)  # [rows, 3H] low, mid, high
            self.records.append((last, aux, {}))
        self._inputs = {}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        lean.remove_tap(self._model, self)

    def lookup(self, last: torch.Tensor, kept: list[tuple[torch.Tensor, torch.Tensor, dict]] = ()
               ) -> list[torch.Tensor | None]:
        """[m, H] committed last-layer rows -> each one's [3H] features, or None where no record
        holds it (newest forwards first, then ``kept``: records a row's drafter took from earlier
        forwards, :meth:`Eagle3.observe`)."""
        found: list[torch.Tensor | None] = [None] * len(last)
        keys = [tuple(row) for row in last[:, :4].tolist()]
        for hidden, aux, index in chain(reversed(self.records), reversed(kept)):
            if not index:  # built once per forward, on first use
                index.update({tuple(row): i for i, row in enumerate(hidden[:, :4].tolist())})
            for j, key in enumerate(keys):
                i = index.get(key)
                if found[j] is None and i is not None and torch.equal(hidden[i], last[j]):
                    found[j] = aux[i]
            if all(row is not None for row in found):
                break
        return found

    def features(self, last: torch.Tensor, kept: list[tuple[torch.Tensor, torch.Tensor, dict]] = ()) -> torch.Tensor:
        """[m, H] committed last-layer rows -> their [m, 3H] features (:meth:`lookup`);
        MissingFeatures when a row is in no record."""
        found = self.lookup(last, kept)
        missing = sum(row is None for row in found)
        if missing:
            raise MissingFeatures(f"{missing} of {len(last)} rows not tapped")
        return torch.stack(found)


def after_untapped(found: list[torch.Tensor | None]) -> int:
    """The index after the last row ``lookup`` found no features for (0: every row found)."""
    return next((j + 1 for j in range(len(found) - 1, -1, -1) if found[j] is None), 0)


# ---- training (``hasten train eagle3``) ---------------------------------------------------------------
@dataclass(frozen=True)
class Eagle3TrainOptions(Settings):
    draft_vocab: int = option(4096, "draft vocabulary: the most frequent tokens of the target's answers")
    intermediate_size: int = option(0, "MLP width of the layer (0: the target's)")
    ttt_steps: int = option(3, "training-time test: steps the layer runs on its own outputs (1: none)")
    decay: float = option(0.8, "loss weight of training-time-test step j is decay**j")

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "draft_vocab", "ttt_steps")
        if self.intermediate_size < 0 or not 0 < self.decay <= 1:
            raise ValueError("intermediate_size must be >= 0 and decay in (0, 1]")


class Eagle3Training(TrainedTraining):
    Options = Eagle3TrainOptions

    def __init__(self, target: PreTrainedModel, options: Eagle3TrainOptions):
        super().__init__(target, options)
        self.vocabulary: tuple[int, ...] = ()
        self.aux_layers = default_aux_layers(num_layers(target))
        self._targets: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}  # row tokens -> (aux, greedy next)

    def prepare(self, data) -> None:
        """The draft vocabulary: the most frequent answer tokens of the training rows (prompt
        tokens break ties), ascending; and the target's outputs on every row."""
        vocab = self.target.get_output_embeddings().weight.shape[0]
        rows = data.split()[0]
        ids, lengths, prompts = data.ids[rows], data.lengths[rows], data.prompt_lengths[rows]  # [N, L], [N], [N]
        position = torch.arange(ids.shape[1])[None]
        answers = (position >= prompts[:, None]) & (position < lengths[:, None])  # [N, L]
        anywhere = position < lengths[:, None]
        counts = (torch.bincount(ids[answers], minlength=vocab).double() * 1000
                  + torch.bincount(ids[anywhere], minlength=vocab).double())
        keep = min(self.options.draft_vocab, vocab)
        self.vocabulary = tuple(sorted(counts.argsort(descending=True, stable=True)[:keep].tolist()))
        if set(self.feature_layers()) <= set(getattr(data, "layers", ())) and getattr(data, "stores_greedy", False):
            return  # a feature store (hasten.training.features) brings them with every batch
        for row, length in enumerate(data.lengths.tolist()):  # every row's target outputs, once, before the clock
            self.row_outputs(data.ids[row, :length])

    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.aux_layers)

    def build(self) -> Eagle3Layer:
        return Eagle3Layer.for_target(self.target, self.vocabulary, self.options.intermediate_size, self.aux_layers)

    def measured_levels(self, module: Eagle3Layer) -> int:
        return self.options.ttt_steps

    @torch.no_grad()
    def row_outputs(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n] one row's tokens -> the target's [n, 3H] low/mid/high features (float16) and [n]
        greedy next tokens, computed once and kept in memory for the rest of training."""
        key = row.cpu().numpy().tobytes()
        if key not in self._targets:
            out = self.target(row[None].to(self.target.device), output_hidden_states=True)
            features = torch.cat([out.hidden_states[k][0] for k in self.aux_layers], -1)  # [n, 3H]
            self._targets[key] = (features.half().cpu(), out.logits[0].argmax(-1).cpu())
        return self._targets[key]

    def target_outputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, 3H] features and [B, T] greedy next tokens of the batch's rows (zero past each row):
        the batch's own where its data stores them, else computed once per row and kept."""
        stored = batch.features or {}
        if batch.greedy is not None and all(k in stored for k in self.aux_layers):
            return torch.cat([stored[k] for k in self.aux_layers], -1).float(), batch.greedy
        B, T = batch.ids.shape
        width = self.target.get_input_embeddings().weight.shape[1]
        aux = torch.zeros(B, T, len(self.aux_layers) * width)
        greedy = torch.zeros(B, T, dtype=torch.long)
        for b, length in enumerate(valid_positions(batch).sum(1).tolist()):
            features, next_tokens = self.row_outputs(batch.ids[b, :length])
            aux[b, :length], greedy[b, :length] = features.float(), next_tokens
        return aux.to(batch.ids.device), greedy.to(batch.ids.device)

    def loss(self, module: Eagle3Layer, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        aux, greedy = self.target_outputs(batch)  # [B, T, 3H], [B, T]
        valid = valid_positions(batch)  # [B, T]
        embeds = self.target.get_input_embeddings()(batch.ids).detach()  # [B, T, H]
        draft_index = torch.full((module.config.vocab_size,), -1, dtype=torch.long, device=batch.ids.device)
        draft_index[module.to_target(torch.arange(module.draft_vocab_size, device=batch.ids.device))] = \
            torch.arange(module.draft_vocab_size, device=batch.ids.device)
        n = batch.ids.shape[1] - 1  # pairs (aux_t, x_{t+1}), t < n
        hidden, steps = module.fuse(aux[:, :n]), TrainingTimeTest(n)
        total, metrics = torch.zeros((), device=hidden.device), {}
        for j in range(min(self.options.ttt_steps, n)):
            ahead = (torch.arange(n, device=hidden.device) + 1 + j).clamp(max=n)  # [n] index of x_{t+1+j}
            positions = (torch.arange(n, device=hidden.device) + j).expand(len(hidden), -1)  # [B, n]
            hidden = module.attend_and_mix(hidden, embeds[:, ahead], positions, steps.attend)  # [B, n, H]
            labels = draft_index[greedy[:, ahead]]  # [B, n] the target's next token, in the draft vocabulary
            scored = valid[:, ahead] & (torch.arange(n, device=hidden.device) + 1 + j <= n)  # [B, n]
            logits = module.logits(hidden)[scored].float()  # [M, Vd]
            learnable = labels[scored] >= 0
            if learnable.any():
                total = total + self.options.decay**j * F.cross_entropy(logits[learnable], labels[scored][learnable])
            if len(logits):
                rank_hits(logits, labels[scored], j + 1, metrics)  # out-of-vocabulary labels (-1) count as misses
        if "head1_rank0" in metrics:
            metrics["top1"] = metrics["head1_rank0"]
        return total, metrics


class TrainingTimeTest:
    """The attention of the training-time test: step 0 is causal over the pairs; step j's
    query at pair t sees step 0's keys at pairs <= t and the keys of steps 1..j at pair t."""

    def __init__(self, n: int):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.causal = torch.ones(n, n, dtype=torch.bool).tril()  # [n, n]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, heads, n, d]; k, v: [B, kv, n, d] this step's -> [B, heads, n, d]."""
        groups = q.shape[1] // k.shape[1]
        self.keys.append(k.repeat_interleave(groups, 1))
        self.values.append(v.repeat_interleave(groups, 1))
        scale = q.shape[-1] ** -0.5
        first = (q @ self.keys[0].transpose(-1, -2) * scale).masked_fill(~self.causal.to(q.device), float("-inf"))
        own = [(q * key).sum(-1, keepdim=True) * scale for key in self.keys[1:]]  # [B, heads, n, 1] each
        weights = torch.cat([first, *own], -1).softmax(-1)  # [B, heads, n, n + steps so far - 1]
        n = q.shape[2]
        out = weights[..., :n] @ self.values[0]
        for i, value in enumerate(self.values[1:]):
            out = out + weights[..., n + i, None] * value
        return out


# ---- the drafter ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Eagle3Settings(WeightsSetting):
    depth: int = 3  # tokens per draft chain (vLLM's num_speculative_tokens)

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "depth")


@register
class Eagle3(TrainedDrafter):
    name = "eagle3"
    Settings = Eagle3Settings
    Module = Eagle3Layer
    Training = Eagle3Training  # how `hasten train eagle3` builds, trains and saves the layer

    taps: LayerTaps | None = None

    def setup(self, model: PreTrainedModel) -> None:
        if self.taps is not None:
            self.taps.remove()
        self.taps = LayerTaps(model, tuple(self.module.config.aux_layers))
        weakref.finalize(self, self.taps.remove)  # the hooks leave the user's model with the drafter

    def start(self, ctx: DraftContext) -> Eagle3Run:
        return Eagle3Run()

    def observe(self, ctx: DraftContext, result: StepResult) -> None:
        """Keep the features of the rows committed since the layer last caught up: the taps
        hold only the latest ``KEPT_FORWARDS`` forwards, and a draft after a longer plain
        stretch (the planner keeps plain steps where drafts do not pay) would otherwise run the
        target again over every committed token (a 1,500-token prompt: about as long as its
        prefill)."""
        state: Eagle3Run = ctx.state
        if self.taps is None or ctx.features is None:
            return
        count, start = len(ctx.features), max(state.cache.length + state.shift, state.kept_to)
        if count > start:
            rows = ctx.features[start:count].clone()  # [new, H] (the loop may write over its buffer)
            found = self.taps.lookup(rows)
            first = after_untapped(found)
            if first and self._starts_after_untapped(state, start + first):
                found, rows = found[first:], rows[first:]
            elif first:  # not tapped in the middle of what the layer runs: its catch-up runs the target once
                found = []
            if found:
                state.kept.append((rows, torch.stack(found), {}))
            state.kept_to = count

    @staticmethod
    def _starts_after_untapped(state: Eagle3Run, position: int) -> bool:
        """Start the layer at committed ``position`` when the rows before it have no features
        (a server's prompt whose states were not reported: Drafter.drafts_without_prompt_features)
        and the layer has run nothing yet; False when it has (those rows must be run)."""
        if state.cache.length or state.kept:
            return False
        state.shift = max(state.shift, position)
        return True

    def drafts_without_prompt_features(self) -> bool:
        return True  # it starts after the prompt's untapped rows (observe, draft)

    def deepest(self) -> int:
        return self.settings.depth

    def cache_bytes(self, state: CommittedRun) -> int:
        return allocated_bytes(state.cache.view())

    @torch.no_grad()
    def features(self, ctx: DraftContext, start: int, end: int) -> torch.Tensor:
        """[end - start, 3H] the target's low/mid/high features at committed positions [start, end)."""
        try:
            return self.taps.features(ctx.features[start:end], getattr(ctx.state, "kept", ()))
        except MissingFeatures:  # one forward over the committed tokens, without the loop's cache
            ids = torch.tensor([ctx.tokens[:end]], device=self.module.fc.weight.device)
            hidden = self._target(ids, output_hidden_states=True, logits_to_keep=1).hidden_states
            return torch.cat([hidden[k][0, start:end] for k in self.module.config.aux_layers], -1)

    def draft(self, ctx: DraftContext) -> Draft:
        return self.draft_rows([ctx])[0]

    def draft_rows(self, ctxs: list[DraftContext]) -> list[Draft]:
        """Every row's chain, the layer run once for all the rows' catch-ups and once per depth for
        their chains, each row over its own cache (:meth:`Eagle3Layer.forward_rows`): on hasten's
        row-invariant kernels a row drafts in a batch exactly what it drafts alone."""
        module, device = self.module, self.module.fc.weight.device
        self._catch_up(ctxs, device)
        depths = [min(self.settings.depth, ctx.max_depth) if ctx.state.newest is not None else 0 for ctx in ctxs]
        live = [r for r, depth in enumerate(depths) if depth > 0]  # rows still drafting
        chains: list[list[int]] = [[] for _ in ctxs]
        hidden = torch.stack([ctxs[r].state.newest for r in live])[None] if live else None  # [1, R, H] pre-norm
        d = 0
        while live:
            if d:  # feed (pre-norm output, guessed token) back at position r + d - 1, after each chain so far
                caches = [ctxs[r].state.cache for r in live]
                rows = [(cache, cache.length + d - 1, 1, None) for cache in caches]
                positions = torch.tensor([[start for _, start, _, _ in rows]], device=device)  # [1, R]
                embeds = self.embed(torch.tensor([[chains[r][-1] for r in live]], device=device))  # [1, R, H]
                hidden = module.forward_rows(hidden, embeds, positions, rows)  # [1, R, H]
            guesses = module.to_target(module.logits(hidden[0]).argmax(-1)).tolist()  # [R] target ids
            for r, token in zip(live, guesses):
                chains[r].append(token)
            d += 1
            going = [j for j, r in enumerate(live) if d < depths[r]]
            live, hidden = [live[j] for j in going], hidden[:, going]
        return [Draft.chain(chain) if chain else EMPTY_DRAFT for chain in chains]

    def _catch_up(self, ctxs: list[DraftContext], device) -> None:
        """Run the layer over every row's committed positions it has not run, all rows in one call
        (rows without features, a server's prompt whose states were not reported, were moved past
        by observe and are not run)."""
        module = self.module
        features, tokens, positions, rows, runs = [], [], [], [], []
        for ctx in ctxs:
            state: Eagle3Run = ctx.state
            count = 0 if ctx.features is None else len(ctx.features)
            start = state.pending(count)
            if start is not None:  # (aux_t, x_{t+1}) for t in [start, count)
                entry = state.cache.length
                features.append(self.features(ctx, start, count))  # [n, 3H]
                tokens.extend(ctx.tokens[start + 1 : count + 1])
                positions.append(torch.arange(entry, count - state.shift, device=device))  # [n]
                rows.append((state.cache, entry, count - start, causal(count - start, entry, device)))
                runs.append((state, count))
            state.kept.clear()  # the layer runs every committed row now: what was kept is spent
            state.kept_to = 0
        if not rows:
            return
        hidden = module.fuse(torch.cat(features))[None]  # [1, N, H]
        embeds = self.embed(torch.tensor(tokens, device=device))[None]  # [1, N, H]
        out = module.forward_rows(hidden, embeds, torch.cat(positions)[None], rows)  # [1, N, H]
        at = 0
        for (state, count), (_, _, n, _) in zip(runs, rows):
            at += n
            state.ran(count, out[0, at - 1])
