"""A tiny torchtitan llama3 run for CPU: the config (``--module titan_config --config tiny``) and
its local assets (a byte-level BPE tokenizer and a JSON-lines data set, written by
``write_assets``).  The model is torchtitan's own debug model; only the batch, the sequence
length, the steps and the backend (DTensor for TP, FSDP2: ``partial_dtensor``) are set here, and
``TINY_TITAN_AC`` picks the activation checkpointing (``none``, ``full``, ``selective``)."""
import json
import os
import random

ASSETS = "TINY_TITAN_ASSETS"


def tiny():
    from torchtitan.models.llama3 import config_registry as reg

    config = reg.llama3_debugmodel()
    root = os.environ[ASSETS]
    config.hf_assets_path = os.path.join(root, "tokenizer")
    config.dataloader.dataset_path = os.path.join(root, "data")
    config.training.local_batch_size = 2
    config.training.seq_len = 32
    config.training.steps = 3
    config.validator.enable = False
    config.parallelism.spmd_backend = "partial_dtensor"
    ac = os.environ.get("TINY_TITAN_AC", "none")
    config.activation_checkpoint = {"none": None, "full": reg.FullAC.Config(), "selective": reg.SelectiveAC.Config()}[ac]
    return config


def tiny_sdpa():
    """``tiny`` with torchtitan's SDPA inner attention (causal over the whole sequence) in every
    layer, as torchtitan's own context-parallel tests build it (its FlexAttention path gathers
    keys and values instead of a ring)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = tiny()
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def write_assets(root: str) -> None:
    """A tokenizer trained on the data set's text, and the data set (200 short documents)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(os.path.join(root, "tokenizer"), exist_ok=True)
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "from", "home", "into", "woods",
             "and", "sun", "was", "bright", "over", "hills"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "." for _ in range(200)]
    with open(os.path.join(root, "data", "train.jsonl"), "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(os.path.join(root, "tokenizer", "tokenizer.json"))
    with open(os.path.join(root, "tokenizer", "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
                   "add_eos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
