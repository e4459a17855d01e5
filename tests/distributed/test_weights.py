"""No process holds the whole model unless it must: under FSDP2 each rank reads only its own rows
of the weights, and final/ is written as sharded safetensors files by the ranks that gather them.

Two random float32 Qwen2 models (1 and 7 layers: about 112 and 383 MB, the same largest tensor)
under 2 gloo ranks (tests/distributed/weights_ranks.py): rank 0's peak host memory above what
was resident before loading, and while writing final/, stays about the same for both sizes (a
couple of the largest tensor), while the old path (rank 0 reads the whole model and broadcasts;
final/ gathered to rank 0) grows with the model. Vocabulary 8191 and MLP width 2815 are odd, so
the embeddings, the head and the MLP projections are cut unevenly over the 2 ranks."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from preftune.distributed.weights import rows
from preftune.model import hf_files
from tests.distributed.ranks import ROOT, free_port
from tests.hf_folder import folder_state

MB = 2**20
LARGEST = 8191 * 1024 * 4  # the embedding and the head, float32 bytes
LAYERS = {"small": 1, "large": 7}


def random_qwen2(folder, layers: int) -> int:
    """A random float32 Qwen2 of `layers` blocks in `folder`; returns its weight bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", vocab_size=8191, hidden_size=1024, intermediate_size=2815,
                               num_hidden_layers=layers, num_attention_heads=16,
                               num_key_value_heads=4, max_position_embeddings=64,
                               tie_word_embeddings=False)
    torch.manual_seed(layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(folder))
    return sum(p.numel() * 4 for p in model.parameters())


# glibc keeps freed blocks below its (growing) mmap threshold in the heap: a fixed threshold
# returns each freed tensor to the system, so the peak is what the code holds, not the heap
MEASURED_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}


def two_ranks(model, out) -> list[dict]:
    """tests/distributed/weights_ranks.py on 2 gloo ranks; each rank's numbers."""
    port = free_port()
    env = os.environ | MEASURED_ENV | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.weights_ranks", str(model),
                               str(out)], env=env | {"RANK": str(r), "LOCAL_RANK": str(r)},
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, layers in LAYERS.items():
        tmp = tmp_path_factory.mktemp(name)
        size = random_qwen2(tmp / "model", layers)
        out[name] = {"size": size, "folder": tmp, "ranks": two_ranks(tmp / "model", tmp)}
        if name != "small":  # only the small run's folders are read again: a GB less on disk
            for folder in ("new", "old", "model"):
                shutil.rmtree(tmp / folder)
    return out


def test_rank_0_memory_no_longer_grows_with_the_model(runs):
    small, large = (runs[n]["ranks"][0] for n in ("small", "large"))
    print({n: {k: v / MB if type(v) is int else v for k, v in runs[n]["ranks"][0].items()}
           for n in runs})
    for r in (small, large):
        # beyond its own shard, loading holds about the one tensor being read
        assert r["load_new"] - r["shard"] < 2 * LARGEST
        assert r["final_new"] < 3 * LARGEST  # the tensor gathered (its pieces and the whole)
    assert abs((large["load_new"] - large["shard"]) - (small["load_new"] - small["shard"])) < 16 * MB
    assert abs(large["final_new"] - small["final_new"]) < 16 * MB
    # the old path: rank 0 holds the whole model while loading and more while writing final/
    big = runs["large"]["size"]
    assert large["load_old"] - large["shard"] > big and large["final_old"] > 2 * big


def test_sliced_load_is_the_broadcast_bit_for_bit(runs):
    for run in runs.values():
        assert all(r["same_shards"] and r["same_buffers"] for r in run["ranks"])


def test_sharded_final_is_the_gathered_one_and_loads_in_transformers(runs):
    from transformers import AutoModelForCausalLM

    folder = runs["small"]["folder"]
    new, old = folder / "new" / "final", folder / "old" / "final"
    index = json.loads((new / hf_files.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == hf_files.file_names(2) and not (new / hf_files.SINGLE).exists()
    a, b = folder_state(new), load_file(str(old / hf_files.SINGLE))
    assert a.keys() == b.keys() == index["weight_map"].keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    for f in files:  # each name maps to the file that holds it
        assert set(load_file(str(new / f))) == {k for k, v in index["weight_map"].items() if v == f}
    loaded = AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], a[k]) for k in a)
    assert json.loads((new / "config.json").read_text()) == json.loads((old / "config.json").read_text())


@pytest.mark.parametrize("n", [0, 1, 5, 7, 8, 9, 2815, 8191])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_rows_cut_as_torch_chunk(n, world):
    """FSDP2's Shard(0): torch.chunk's pieces, the last ranks' shorter or empty."""
    pieces = [len(c) for c in torch.arange(n).chunk(world)] if n else []
    pieces += [0] * (world - len(pieces))
    got = [rows(n, world, r) for r in range(world)]
    assert [b - a for a, b in got] == pieces
    assert got[0][0] == 0 and got[-1][1] == n and all(got[i][1] == got[i + 1][0]
                                                      for i in range(world - 1))


def test_file_writer_streams_a_safetensors_file_and_the_split_has_no_empty_file(tmp_path):
    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "a": torch.arange(7),
               "c": torch.randn(2, 0), "d": torch.tensor(2.5, dtype=torch.float64)}
    specs = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    w = hf_files.FileWriter(tmp_path / "x.safetensors", specs)
    with pytest.raises(ValueError, match="not the next tensor"):
        w.write("a", tensors["a"])
    for k, v in tensors.items():
        w.write(k, v)
    w.close()
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    stored = hf_files.stored(tmp_path)  # no index, no model.safetensors: nothing
    assert stored == {}
    (tmp_path / "x.safetensors").rename(tmp_path / hf_files.SINGLE)
    stored = hf_files.stored(tmp_path)
    assert hf_files.read_rows(stored["b"], "b", 1, 3, torch.float32).equal(tensors["b"][1:3].float())
    sizes = [(f"t{i}", (s,), torch.float32) for i, s in enumerate([1, 1000, 1, 1, 1, 10])]
    for files in (1, 2, 3, 6, 9):
        groups = hf_files.split(sizes, files, max_bytes=10**9)
        assert all(groups) and sum(groups, []) == list(range(len(sizes)))
        assert len(groups) <= max(files, 1)
    assert len(hf_files.split(sizes, 1, max_bytes=3000)) == 2  # 4 KB over 3 KB files


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_lora_is_written_merged_tensor_by_tensor_as_peft_merges(tmp_path, dtype, targets):
    """final/ of a LoRA run: each adapted projection's base weight and adapter merged as it is
    written (no merged copy of the model), bit for bit what PEFT's merge_and_unload saves."""
    from preftune.config import ModelConfig
    from preftune.distributed.weights import write_weights
    from preftune.model.load import DTYPES, load_model, load_tokenizer, save_pretrained
    from tests.conftest import MODEL_DIR

    cfg = ModelConfig(dtype=dtype)
    cfg.lora.enabled, cfg.lora.r = True, 4
    cfg.lora.target_modules = targets if targets == "all-linear" else targets.split(",")
    model = load_model(cfg, str(MODEL_DIR))
    torch.manual_seed(0)
    with torch.no_grad():  # adapters away from B = 0, so the merge changes the weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    (tmp_path / "new").mkdir()
    write_weights(model, tmp_path / "new", DTYPES[dtype])
    save_pretrained(model, load_tokenizer(str(MODEL_DIR)), tmp_path / "peft", dtype=dtype)
    new, want = load_file(str(tmp_path / "new" / hf_files.SINGLE)), load_file(
        str(tmp_path / "peft" / hf_files.SINGLE))
    assert new.keys() == want.keys() and all(new[k].dtype == DTYPES[dtype] for k in new)
    assert all(torch.equal(new[k], want[k]) for k in want)
    base = load_file(str(MODEL_DIR / hf_files.SINGLE))
    changed = {k for k in want if not torch.equal(want[k], base[k].to(DTYPES[dtype]))}
    assert changed and all(k.endswith("_proj.weight") for k in changed)


def test_per_expert_qwen3_moe_is_read_in_slices_like_the_broadcast(tmp_path):
    """A Qwen3-MoE folder as transformers saves it (one module per expert) under 2 ranks: each rank
    stacks only its own experts (Qwen3Moe.read_stored), bit for bit the shards rank 0's whole
    load sends, and final/ is the gathered one."""
    from preftune.model.hf_files import stored
    from preftune.model.qwen3_moe import Qwen3Moe
    from tests.model.test_qwen3_moe import _folder

    _, folder = _folder(tmp_path, per_expert=True)
    assert Qwen3Moe.stored_layout(stored(folder))  # the stacked experts come from their modules
    ranks = two_ranks(folder, tmp_path)
    assert all(r["same_shards"] and r["same_buffers"] for r in ranks)
    new, old = folder_state(tmp_path / "new" / "final"), load_file(str(tmp_path / "old" / "final" / hf_files.SINGLE))
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)
