"""A learner step's output policy in HF format, for vLLM: `export_root/vNNNN/hf` with the base
policy's tokenizer and the `perpetua_*` lineage fields in config.json; and the content hash that
identifies it (the data version of its `policy_checkpoint` materialization)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


class TokenizerFiles:
    """The base policy's tokenizer, copied file by file into each export (the tokenizer never
    changes during RL), with the special-token ids `hf_convert.hf_config` records."""

    def __init__(self, hf_dir: Path):
        self.hf_dir = Path(hf_dir)
        config = json.loads((self.hf_dir / "config.json").read_text())
        ids = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        if ids["pad_token_id"] is None and (self.hf_dir / "tokenizer.json").exists():
            from ops.policy.tokenizer import load_hf_tokenizer

            tok = load_hf_tokenizer(self.hf_dir)
            ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        self.bos_token_id, self.eos_token_id, self.pad_token_id = ids["bos_token_id"], ids["eos_token_id"], ids["pad_token_id"]

    def save_pretrained(self, out_dir: str) -> None:
        for name in _TOKENIZER_FILES:
            if (self.hf_dir / name).exists():
                shutil.copy2(self.hf_dir / name, Path(out_dir) / name)


def export_policy(policy, full_sd, hf_dir: Path, tokenizer: TokenizerFiles, meta: dict) -> None:
    """Write the policy of checkpoint `meta` (full megatron state dict) to `hf_dir`, published
    whole or not at all (`hf_convert.export_hf`)."""
    from ops.policy import hf_convert

    hf_convert.export_hf(policy, full_sd, hf_dir, tokenizer, extra=_lineage_fields(meta))


def write_export(policy, full_sd, out_dir: Path, tokenizer: TokenizerFiles, meta: dict) -> None:
    """The same files into `out_dir`, a directory claimed and published by the caller: the learner
    step writes them before its checkpoint is committed and publishes them after."""
    from ops.policy import hf_convert

    hf_convert.write_hf(policy, full_sd, out_dir, tokenizer, extra=_lineage_fields(meta))


def _lineage_fields(meta: dict) -> dict:
    """The `perpetua_*` fields an exported policy's config.json carries (its version and parent)."""
    return {"perpetua_policy_version": meta["policy_version"], "perpetua_parent_policy_version": meta["parent_policy_version"],
            "perpetua_batch_id": meta["batch_id"]}


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def parent_data_version(export_root: Path, version_in: int) -> str | None:
    """The data version of the policy_checkpoint materialization a step continues from: the
    hash of version_in's export (what that materialization reported). None from the base policy,
    which is an input of its own."""
    from ops.policy.versions import policy_dir

    weights = policy_dir(export_root, version_in) / "model.safetensors"
    return file_hash(weights) if version_in > 0 and weights.exists() else None
