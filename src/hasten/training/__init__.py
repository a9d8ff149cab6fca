"""Training the small modules trained drafters add on top of a frozen target.

* :mod:`.distill`: self-distillation data (the target's own continuations and hidden states);
* :mod:`.trainer`: the :class:`~.trainer.Trainable` protocol and the generic training loop;
* :mod:`.selfgen`: conversations a chat model writes itself (``hasten train data``);
* :mod:`.recipe`: every trained drafter of a model from those conversations (``hasten train recipe``):
  :mod:`.conversations` (rows, the held-out split), :mod:`.features` and :mod:`.feature_data`
  (the target's hidden states, extracted once), :mod:`.acceptance` and :mod:`.acceptance_log`
  (held-out acceptance per depth against the tokens trained on);
* :mod:`.cli`: ``hasten train NAME``, for every registered drafter with a ``Training`` recipe.

Nothing is imported here, so drafters can import :mod:`.trainer` without cycles.
"""
