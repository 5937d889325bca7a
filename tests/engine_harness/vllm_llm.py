"""A real `vllm.LLM` on CPU with a tiny Qwen3-MoE written here (2 layers, 8 experts, top-2, hidden 128,
head_dim 32; dummy weights, no tokenizer), with the plugin's entry point enabled (EMOE_SOCKET set).
Prints one JSON line: the generated token ids, and the plugin's status in the driver and in each worker
(`collective_rpc`). Run by tests/engines/test_engine_vllm.py with the engine virtualenv:

    python tests/engine_harness/vllm_llm.py DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False,
    "attention_dropout": 0.0, "output_router_logits": False, "router_aux_loss_coef": 0.001,
    "use_sliding_window": False,
}


def worker_status(worker: object) -> dict[str, object]:
    """Runs inside each vLLM worker (`collective_rpc` passes the worker)."""
    from dataplane_shim import vllm_plugin

    runner = getattr(worker, "model_runner", None)
    return dict(vllm_plugin.status(), eplb_state=getattr(runner, "eplb_state", None) is not None)


def main() -> None:
    d = Path(sys.argv[1])
    model = d / "tinymoe"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    os.environ.setdefault("EMOE_SOCKET", str(d / "agent.sock"))
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    from vllm import LLM, SamplingParams

    from dataplane_shim import vllm_plugin

    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=128,
              max_num_seqs=4, enforce_eager=True, max_num_batched_tokens=128, tensor_parallel_size=1,
              gpu_memory_utilization=0.3)  # on CPU: a share of the free host memory, which other work uses
    sp = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [3, 4, 5, 6, 7]}, {"prompt_token_ids": [10, 11, 12]}], sp)
    workers = llm.collective_rpc(worker_status)
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                  "driver": vllm_plugin.status(), "workers": workers}), flush=True)


if __name__ == "__main__":
    main()
