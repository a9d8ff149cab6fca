"""Training the small modules trained drafters add on top of a frozen target.

* :mod:`.distill`: self-distillation data (the target's own continuations and hidden states);
* :mod:`.trainer`: the :class:`~.trainer.Trainable` protocol and the generic training loop;
* :mod:`.cli`: ``hasten train NAME``, for every registered drafter with a ``Training`` recipe.

Nothing is imported here, so drafters can import :mod:`.trainer` without cycles.
"""
