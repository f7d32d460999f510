"""LoRA adapters on the engine (issue 37): three PEFT adapters of different ranks and targets (one rsLoRA, one over
some layers only) on tiny random Llama, Qwen3 and Gemma 2 models; rows of every adapter and the base mixed in one
step give transformers + PEFT's greedy tokens (fp32), as they do alone; bf16 sampled rows alone = batched; a step
holds at most max_loras adapters (the others wait) and still gives each row its own text."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from batchjob.engine.config import EngineConfig, SchedulerConfig
from batchjob.engine.engine import Engine
from batchjob.engine.requests import EngineRequest, SamplingParams
from batchjob.lora.adapter import read_adapter
from batchjob.lora.apply import AdapterSet
from batchjob.models.registry import build_model, canonical_weights, config_from_hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
ADAPTERS = [  # (rank, alpha, rslora, targets, layers)
    (4, 8, False, ["q_proj", "v_proj"], None),
    (8, 16, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], None),
    (16, 8, False, ["o_proj", "down_proj", "up_proj"], [1]),
]
PROMPTS = [[5, 17, 33, 80, 2, 9], [7, 7, 21, 40], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [3, 99, 4]]


def make_base(arch: str, hidden: int = 64):
    common = dict(vocab_size=400, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    cls, cfg = {"llama": ("LlamaForCausalLM", transformers.LlamaConfig(**common)),
                "qwen3": ("Qwen3ForCausalLM", transformers.Qwen3Config(**common, head_dim=16)),
                "gemma2": ("Gemma2ForCausalLM", transformers.Gemma2Config(**common, head_dim=16, sliding_window=8,
                                                                          query_pre_attn_scalar=16))}[arch]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.1)
    return model


def save_adapters(base, folder) -> list:
    paths = []
    for k, (rank, alpha, rslora, targets, layers) in enumerate(ADAPTERS):
        torch.manual_seed(100 + k)
        cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                              layers_to_transform=layers, lora_dropout=0.0)
        m = peft.get_peft_model(copy.deepcopy(base), cfg)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.3)  # B is zero at init: draw it so the adapter changes the text
        path = folder / f"adapter{k}"
        m.save_pretrained(path)
        paths.append(path)
    return paths


def reference(base, path, prompt) -> list[int]:
    model = base if path is None else peft.PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    return out[0, len(prompt):].tolist()


def ours(base, paths, kernels="torch", dtype=torch.float32):
    d = base.config.to_dict()
    d["architectures"] = [type(base).__name__]
    config = config_from_hf(d)
    weights = canonical_weights(config, {k: v.detach().clone().to(dtype) for k, v in base.state_dict().items()})
    return build_model(config, weights, dtype, kernels=kernels,
                       adapters=AdapterSet.of([read_adapter(f"a{k}", p) for k, p in enumerate(paths)]))


def run(model, rows: list[tuple[int, int]], params=GREEDY, max_loras: int = 8, block_size: int = 8, first: int = 0):
    """rows: (prompt index, adapter slot or -1); their row indices (random streams) from `first` on."""
    engine = Engine(model, [], EngineConfig(num_blocks=256, block_size=block_size,
                                            scheduler=SchedulerConfig(max_num_seqs=16, max_loras=max_loras)))
    ids = {}
    for i, (p, slot) in enumerate(rows):
        got = engine.submit(EngineRequest(PROMPTS[p], params, seed=0, row_index=first + i, lora=slot))
        assert isinstance(got, int), got
        ids[got] = i
    out = {}
    while engine.has_work:
        for r in engine.run_step():
            out[ids[r.request_id]] = list(r.output_ids)
    return [out[i] for i in range(len(rows))]


ROWS = [(p, slot) for p in range(len(PROMPTS)) for slot in (-1, 0, 1, 2)]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_greedy_tokens_equal_transformers_and_peft_mixed_in_one_step_and_alone(arch, tmp_path):
    base = make_base(arch)
    paths = save_adapters(base, tmp_path)
    want = [reference(base, None if s < 0 else paths[s], PROMPTS[p]) for p, s in ROWS]
    assert len({tuple(w) for w in want[:4]}) == 4  # each adapter changes the text
    model = ours(base, paths)
    assert run(model, ROWS) == want
    assert [run(model, [row])[0] for row in ROWS[:8]] == want[:8]
    assert run(model, ROWS, max_loras=1) == want  # one adapter a step: the others wait, the text is the same


def test_bf16_sampled_rows_alone_equal_batched(tmp_path):
    base = make_base("llama")
    paths = save_adapters(base, tmp_path)
    model = ours(base, paths, kernels="auto", dtype=torch.bfloat16)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, ignore_eos=True)
    batched = run(model, ROWS, params=sampled, block_size=16)
    assert [run(model, [row], params=sampled, block_size=16, first=i)[0] for i, row in enumerate(ROWS)] == batched


def test_adapters_on_int8_weight_matmuls_change_only_their_rows_and_stay_batch_invariant(tmp_path):
    """Under --quantization int8 the base matmuls are int8 and the adapters stay in the compute dtype: the base rows
    give the int8 model's own tokens, the adapter rows others, and bf16 sampled rows alone = batched."""
    base = make_base("llama")
    paths = save_adapters(base, tmp_path)
    d = base.config.to_dict()
    d["architectures"] = [type(base).__name__]
    config = config_from_hf(d)

    def build(with_adapters: bool):
        weights = canonical_weights(config, {k: v.detach().clone().to(torch.bfloat16) for k, v in base.state_dict().items()})
        adapters = AdapterSet.of([read_adapter(f"a{k}", p) for k, p in enumerate(paths)]) if with_adapters else None
        return build_model(config, weights, torch.bfloat16, kernels="auto", quantization="int8", adapters=adapters)

    plain, adapted = build(False), build(True)
    rows = [(p, s) for p in range(len(PROMPTS)) for s in (-1, 1)]
    want_base = run(plain, [(p, -1) for p in range(len(PROMPTS))])
    got = run(adapted, rows)
    assert got[0::2] == want_base and got[1::2] != want_base
    sampled = SamplingParams(max_tokens=8, temperature=0.9, ignore_eos=True)
    batched = run(adapted, rows, params=sampled, block_size=16)
    assert [run(adapted, [row], params=sampled, block_size=16, first=i)[0] for i, row in enumerate(rows)] == batched


def test_prefix_cache_keys_include_the_adapter(tmp_path):
    """The same prompt under the base, then an adapter, then the same adapter again: only the last is a hit."""
    base = make_base("llama")
    model = ours(base, save_adapters(base, tmp_path))
    engine = Engine(model, [], EngineConfig(num_blocks=256, block_size=4, enable_prefix_caching=True))
    prompt = PROMPTS[2]
    hits = []
    for slot in (-1, 0, 0, 1):
        engine.submit(EngineRequest(prompt, GREEDY, seed=0, row_index=0, lora=slot))
        hit = 0
        while engine.has_work:
            engine.run_step()
            hit += engine.last_stats.prefix_hit_tokens if engine.last_stats else 0
        hits.append(hit)
    assert hits[0] == hits[1] == hits[3] == 0 and hits[2] == 8  # its full blocks but the last


def _state(model) -> dict:
    """What the model and its layers hold: each attribute's name and the object it names."""
    held = {f"model.{k}": id(v) for k, v in vars(model).items()}
    for i, layer in enumerate(model.layers):
        for part in ("attn", "mlp"):
            block = getattr(layer, part)
            held |= {f"{i}.{part}.{f.name}": id(getattr(block, f.name)) for f in dataclasses.fields(block)}
    return held


def test_a_model_gains_no_attributes_after_it_is_built_and_keeps_no_step_state(tmp_path):
    # the adapters are the model's from its build; a step's adapters travel down the forward as the step's own
    # input: running rows with and without adapters changes nothing the model or its layers hold
    base = make_base("llama")
    paths = save_adapters(base, tmp_path)
    model = ours(base, paths)
    assert model.layers[0].attn.qkv_lora is not None and model.layers[0].mlp.down_lora is not None
    built = _state(model)
    run(model, ROWS[:2])  # an engine fits the model's kernels to its block size (the model's own method)
    fitted = _state(model)
    assert fitted.keys() == built.keys()
    assert {k for k in built if built[k] != fitted[k]} == {"model.kernels", "model.block_size"}
    run(model, ROWS[2:8])
    assert _state(model) == fitted
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.adapters.adapters = ()  # the adapter set is frozen: nothing of a step is kept on it
    assert "lora" in model.weight_memory()
