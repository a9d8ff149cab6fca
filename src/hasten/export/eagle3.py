"""hasten's EAGLE-3 layer in the layouts vLLM and SGLang load (SpecForge's checkpoint layout:
``speculative_config={"method": "eagle3", "model": DIR}`` in vLLM, ``--speculative-algorithm
EAGLE3 --speculative-draft-model-path DIR`` in SGLang).

The tensors are hasten's own, unrenamed: :class:`~hasten.drafters.eagle3_layer.Eagle3Layer`
names its parameters as the checkpoints do (``midlayer.self_attn.q_proj``, ``fc``, ``norm``,
``lm_head``), and vLLM maps ``midlayer.`` to its ``layers.0.`` and fuses q/k/v and gate/up
itself (``vllm/model_executor/models/llama_eagle3.py``). ``d2t`` (int64, draft id -> target id
minus draft id) and ``t2d`` (bool, target id -> in the draft vocabulary) are written when the
draft vocabulary is smaller than the target's; the target's embeddings are not (both engines
share the target's when the checkpoint has none).

The two engines name the three target layers differently: vLLM's
``eagle_aux_hidden_state_layer_ids`` k is the residual stream *entering* layer k (hasten's
convention, Hugging Face's ``hidden_states[k]``); SGLang's and SpecForge's (in ``eagle_config``)
is the *output* of layer k, so the sglang config holds k - 1.
"""
from __future__ import annotations

import torch

from ..drafters.eagle3_layer import Eagle3Layer
from .layout import ExportError, Shape, check

ENGINES = {"vllm": "vLLM's EAGLE-3 (vllm.model_executor.models.llama_eagle3)",
           "sglang": "SGLang's EAGLE-3 (SpecForge's checkpoint layout)"}
INDEX_TENSORS = {"d2t": torch.int64, "t2d": torch.bool}  # not floating: checked apart


def config(layer: Eagle3Layer, format: str, dtype: torch.dtype) -> dict:
    c = layer.config
    aux = list(c.aux_layers)
    if aux != sorted(set(aux)) or len(aux) != 3 or aux[0] < 1:
        # both engines collect the features of distinct layers in layer order (SGLang's ids count from -1)
        raise ExportError(f"the layer reads target layers {aux}: the engines read three distinct layers, ascending, "
                          "from layer 1 on; train one for a target of 4 layers or more")
    written = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.heads, "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim,
        "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_positions, "tie_word_embeddings": False,
        "vocab_size": c.vocab_size, "draft_vocab_size": layer.draft_vocab_size,
        "target_hidden_size": c.hidden_size, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if format == "vllm":
        written["eagle_aux_hidden_state_layer_ids"] = aux
    else:  # SGLang / SpecForge count a layer's output: the residual entering layer k is layer k - 1's output
        written["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [k - 1 for k in aux]}
    return written


def layout(written: dict) -> dict[str, Shape]:
    """The floating parameters the engine's EAGLE-3 module declares for ``written``: name -> shape."""
    H, I = written["hidden_size"], written["intermediate_size"]
    q, kv = written["num_attention_heads"] * written["head_dim"], written["num_key_value_heads"] * written["head_dim"]
    aux = len(written.get("eagle_aux_hidden_state_layer_ids")
              or written.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or (0, 0, 0))
    names = {
        "midlayer.self_attn.q_proj.weight": (q, 2 * H), "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H), "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.mlp.gate_proj.weight": (I, H), "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "fc.weight": (H, aux * written["target_hidden_size"]), "norm.weight": (H,),
        "lm_head.weight": (written["draft_vocab_size"], H),
    }
    names.update({f"midlayer.{norm}.weight": (H,)
                  for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm")})
    return names


def index_layout(written: dict) -> dict[str, Shape]:
    """``d2t`` and ``t2d`` when the draft vocabulary is smaller than the target's; none otherwise."""
    if written["draft_vocab_size"] == written["vocab_size"]:
        return {}
    return {"d2t": (written["draft_vocab_size"],), "t2d": (written["vocab_size"],)}


def tensors(layer: Eagle3Layer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {name: t.detach().to(dtype).contiguous().cpu() for name, t in layer.state_dict().items()}
    if layer.draft_vocab_size != layer.config.vocab_size:
        out["d2t"] = layer.d2t.detach().to(torch.int64).cpu().contiguous()  # [Vd]
        out["t2d"] = layer.t2d.detach().cpu().contiguous()  # [V]
    return out


def check_strictly(written_tensors: dict[str, torch.Tensor], written: dict, engine: str) -> None:
    """The exact names and shapes of both kinds, floating parameters, int64 ``d2t`` and bool ``t2d``
    that agree with each other (every draft id lands on a target id that ``t2d`` marks)."""
    indices = index_layout(written)
    check({k: t for k, t in written_tensors.items() if k not in INDEX_TENSORS}, layout(written), engine)
    given = {k: t for k, t in written_tensors.items() if k in INDEX_TENSORS}
    problems = [f"{k} missing" for k in indices if k not in given]
    problems += [f"{k} unexpected" for k in given if k not in indices]
    for k, t in given.items():
        if k in indices and (tuple(t.shape) != indices[k] or t.dtype != INDEX_TENSORS[k]):
            problems.append(f"{k} {tuple(t.shape)} {t.dtype} (expected {indices[k]} {INDEX_TENSORS[k]})")
    if not problems and indices:
        targets = torch.arange(written["draft_vocab_size"]) + given["d2t"]  # [Vd] target ids
        in_range = bool(((targets >= 0) & (targets < written["vocab_size"])).all())
        if not in_range or int(given["t2d"].sum()) != len(targets) or not bool(given["t2d"][targets].all()):
            problems.append("d2t and t2d disagree (draft ids must map one to one onto the target ids t2d marks)")
    if problems:
        raise ExportError(f"the export does not match what {engine} loads; " + "; ".join(problems))
