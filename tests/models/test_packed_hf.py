"""A packed batch through an imported Hugging Face LLaMA gives each document the loss that
transformers gives it alone (each piece of a split document at its own position ids)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raypipe.core.packed import IGNORE_INDEX
from raypipe.models.hf import from_pretrained
from tests.models.test_hf_interop import LLAMA3, hf_model, save
from tests.models.test_packed_documents import packed_batch


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3], ids=["rope", "llama3-rope"])
def test_packed_documents_match_transformers_on_each_document_alone(tmp_path, rope_scaling):
    hf = hf_model(rope_scaling)
    layers = from_pretrained(save(hf, tmp_path / "hf"))  # no max_seq_len: the checkpoint's 64 positions
    net = torch.nn.Sequential(*(layer.build() for layer in layers)).float()
    inputs, targets, pieces = packed_batch(seed=5, rows=4)
    assert any(piece.start > 0 for piece in pieces)
    with torch.no_grad():
        logits = net(inputs)
        per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)
        ours, theirs = [], []
        for piece in pieces:
            if len(piece.tokens) < 2:
                continue
            tokens = torch.tensor([piece.tokens])
            positions = piece.start + torch.arange(tokens.size(1) - 1)[None]
            hf_logits = hf(input_ids=tokens[:, :-1], position_ids=positions).logits
            theirs.append(F.cross_entropy(hf_logits[0], tokens[0, 1:], reduction="sum"))
            ours.append(per_token[piece.row, piece.begin:piece.begin + len(piece.tokens) - 1].sum())
    torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), rtol=1e-5, atol=1e-5)
