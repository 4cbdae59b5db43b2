"""Packed documents through the LLaMA: each document (each piece of a split one, at its own
positions) gives the loss and gradients it gives alone; the attention kernels agree."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from raypipe.core.schedule import SINGLE_CHUNK_SCHEDULES
from raypipe.core.packed import IGNORE_INDEX, make_packed
from raypipe.models.document_mask import cumulative_lengths, document_attention, document_causal_mask
from raypipe.models.llama import LlamaConfig, llama_layers, llama_loss
from raypipe.run import llama_count_tokens

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=24)
SEQ_LEN = 24
ROW = SEQ_LEN + 1
PAD = 63


@dataclass
class Piece:
    row: int
    begin: int  # column of its first token in the row
    tokens: list[int]
    start: int  # its first token's position in its document


def packed_batch(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, list[Piece]]:
    """Documents of random lengths (some longer than a row) back to back, cut into rows of
    ``SEQ_LEN + 1``, the last one padded; built here, independently of raypipe.data."""
    generator = random.Random(seed)
    stream: list[tuple[int, int, int]] = []  # (token, document, position)
    document = 0
    while len(stream) < rows * ROW - 3:
        length = generator.choice([1, 2, 4, 7, 11]) if document % 4 else generator.randint(30, 70)
        stream += [(generator.randrange(PAD), document, position) for position in range(length)]
        document += 1
    stream = stream[:rows * ROW - 3] + [(PAD, -1, 0)] * 3  # the corpus's last row: 3 tokens of padding
    tokens = torch.tensor([t for t, _, _ in stream]).view(rows, ROW)
    documents = torch.tensor([d for _, d, _ in stream]).view(rows, ROW)
    positions = torch.tensor([p for _, _, p in stream]).view(rows, ROW)
    pieces = []
    for row in range(rows):
        for column in range(ROW):
            label = int(documents[row, column])
            if label >= 0 and (column == 0 or documents[row, column - 1] != label):
                pieces.append(Piece(row, column, [], int(positions[row, column])))
            if label >= 0:
                pieces[-1].tokens.append(int(tokens[row, column]))
    # per row, pieces numbered from 0 (the padding one too); targets stay inside their piece
    ids = torch.zeros_like(documents)
    ids[:, 1:] = (documents[:, 1:] != documents[:, :-1]).cumsum(dim=1)
    targets = tokens[:, 1:].clone()
    targets[(documents[:, 1:] != documents[:, :-1]) | (documents[:, 1:] < 0)] = IGNORE_INDEX
    inputs = make_packed(tokens[:, :-1], torch.where(documents < 0, 0, positions)[:, :-1], ids[:, :-1])
    return inputs, targets, pieces


def model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(layer.build() for layer in llama_layers(CONFIG))).float()


def alone_loss(net: torch.nn.Module, piece: Piece) -> torch.Tensor:
    """The summed next-token loss of one piece run by itself: a whole document through the
    ordinary (unpacked) path; a continuation at its positions."""
    tokens = torch.tensor([piece.tokens])
    if tokens.size(1) == 1:  # a lone token predicts nothing
        return torch.zeros(())
    inputs = tokens[:, :-1]
    if piece.start == 0:
        logits = net(inputs)
    else:
        positions = piece.start + torch.arange(inputs.size(1))[None]
        logits = net(make_packed(inputs, positions, torch.zeros_like(inputs)))
    return F.cross_entropy(logits[0], tokens[0, 1:], reduction="sum")


def test_packed_rows_give_every_document_its_own_loss_and_gradients():
    inputs, targets, pieces = packed_batch(seed=3, rows=5)
    assert any(piece.start > 0 for piece in pieces) and any(len(piece.tokens) == 1 for piece in pieces)
    assert any(piece.start + len(piece.tokens) > CONFIG.max_seq_len for piece in pieces)  # past the table
    net = model()
    logits = net(inputs)
    per_token = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), targets.reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)
    packed_losses = [per_token[piece.row, piece.begin:piece.begin + len(piece.tokens) - 1].sum() for piece in pieces]
    packed_total = per_token.sum()
    packed_total.backward()
    packed_grads = [p.grad.clone() for p in net.parameters()]

    net.zero_grad()
    alone = [alone_loss(net, piece) for piece in pieces]
    torch.stack(alone).sum().backward()
    torch.testing.assert_close(torch.stack(packed_losses), torch.stack(alone).detach(), rtol=1e-5, atol=1e-5)
    for packed, reference in zip(packed_grads, (p.grad for p in net.parameters())):
        torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    # the step's loss is the exact per-token mean: boundaries and padding are neither predicted nor counted
    predicted = sum(len(piece.tokens) - 1 for piece in pieces)
    assert llama_count_tokens(targets) == predicted
    torch.testing.assert_close(llama_loss(logits.detach(), targets), torch.stack(alone).detach().sum() / predicted,
                               rtol=1e-5, atol=0)


def test_one_document_per_row_is_the_unpacked_model_bitwise():
    tokens = torch.randint(0, CONFIG.vocab_size, (3, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    net = model(1)
    packed = make_packed(tokens, torch.arange(SEQ_LEN).expand(3, -1), torch.zeros_like(tokens))
    assert torch.equal(net(packed), net(tokens))


def test_rows_of_one_piece_take_plain_causal_attention_equal_to_the_mask(monkeypatch):
    q, k, v = (torch.randn(2, 8, 4, 16, generator=torch.Generator().manual_seed(seed)) for seed in range(3))
    one_piece = torch.tensor([[0] * 8, [3] * 8])
    masked = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            attn_mask=document_causal_mask(one_piece)).transpose(1, 2)
    monkeypatch.setattr("raypipe.models.document_mask.document_causal_mask",
                        lambda ids: pytest.fail("rows of one piece need no mask"))
    torch.testing.assert_close(document_attention(q, k, v, one_piece), masked, rtol=1e-5, atol=1e-6)


def test_mask_and_boundaries_of_document_ids():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    mask = document_causal_mask(ids)[:, 0]
    expected = torch.tensor([[[i >= j and ids[b, i] == ids[b, j] for j in range(6)] for i in range(6)]
                             for b in range(2)])
    assert torch.equal(mask, expected)
    cumulative, longest = cumulative_lengths(ids)
    assert cumulative.tolist() == [0, 2, 5, 6, 12] and cumulative.dtype == torch.int32 and longest == 6


def test_the_varlen_path_passes_flash_attn_the_pieces(monkeypatch):
    """The flash-attn call's plumbing on CPU: a stand-in with flash_attn_varlen_func's signature
    that attends over each cumulative-length span alone gives the mask path's output."""
    from raypipe.models import attention, document_mask

    calls = []

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
               deterministic=False, return_attn_probs=False, block_table=None):
        calls.append((cu_seqlens_q.tolist(), max_seqlen_q, causal, deterministic))
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k and q.dim() == 3
        spans = zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist())
        return torch.cat([F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None],
            is_causal=causal, enable_gqa=True)[0].transpose(0, 1) for a, b in spans])

    monkeypatch.setattr(document_mask, "_flash_attn_varlen_func", varlen)
    monkeypatch.setattr(attention, "flash_unavailable_reason", lambda q: None)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 10, heads, 8, generator=generator) for heads in (4, 2, 2))
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3], [0] * 10])
    got = document_attention(q, k, v, ids)
    assert calls == [([0, 3, 5, 9, 10, 20], 10, True, attention.FLASH_DETERMINISTIC_BACKWARD)]
    monkeypatch.setattr(document_mask, "_flash_attn_varlen_func", None)
    torch.testing.assert_close(got, document_attention(q, k, v, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_flash_attn_varlen_matches_the_mask_path_at_bf16():
    """On a GPU with flash-attn: the variable-length kernel against SDPA with the block-diagonal mask."""
    pytest.importorskip("flash_attn")
    from raypipe.models import document_mask
    from raypipe.models.attention import flash_unavailable_reason

    assert document_mask._flash_attn_varlen_func is not None
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(3, 128, 8, 64, device="cuda", dtype=torch.bfloat16, generator=generator, requires_grad=True)
    assert flash_unavailable_reason(q) is None
    k = torch.randn(3, 128, 2, 64, device="cuda", dtype=torch.bfloat16, generator=generator, requires_grad=True)
    v = torch.randn(3, 128, 2, 64, device="cuda", dtype=torch.bfloat16, generator=generator, requires_grad=True)
    ids = torch.sort(torch.randint(0, 6, (3, 128), device="cuda", generator=generator), dim=1).values
    flash = document_attention(q, k, v, ids)
    grads = torch.autograd.grad(flash.float().square().sum(), (q, k, v))
    reference_q, reference_k, reference_v = (x.detach().float().requires_grad_() for x in (q, k, v))
    reference = F.scaled_dot_product_attention(
        reference_q.transpose(1, 2), reference_k.transpose(1, 2), reference_v.transpose(1, 2),
        attn_mask=document_causal_mask(ids), enable_gqa=True).transpose(1, 2)
    reference_grads = torch.autograd.grad(reference.square().sum(), (reference_q, reference_k, reference_v))
    torch.testing.assert_close(flash.float(), reference, rtol=2e-2, atol=2e-2)
    for got, expected in zip(grads, reference_grads):
        torch.testing.assert_close(got.float(), expected, rtol=5e-2, atol=5e-2 * float(expected.abs().max()))


@pytest.mark.parametrize("num_stages,num_micro_batches,schedule,activation_checkpoint", [
    (1, 1, "gpipe", "never"), (1, 1, "gpipe", "always"), (2, 2, "1f1b", "never"), (2, 2, "gpipe", "always"),
    (2, 4, "zb_h1", "never"), (3, 2, "1f1b", "except_last"), (4, 2, "zb_h1", "always"),
    (2, 4, "interleaved_1f1b", "never"), (2, 2, "interleaved_1f1b", "always"), (2, 2, "zbv", "except_last"),
    (2, 4, "zbv", "never")])
def test_stages_train_packed_rows_as_one_process_on_each_document(num_stages, num_micro_batches, schedule,
                                                                  activation_checkpoint):
    """The stages themselves (their workers, as the executors run them, without Ray) on a packed
    batch: the step's loss is the per-token mean over every document alone, and the gradients
    theirs. Between stages the hidden states, positions and document ids travel as a tuple, and
    micro-batches are weighted by their predicted tokens (``loss_count_fn``). Every schedule of
    :data:`~raypipe.core.schedule.SCHEDULES`, the chunked ones with two chunks a worker."""
    import raypipe
    from raypipe.testing.op_interpreter import OpInterpreter

    inputs, targets, pieces = packed_batch(seed=9, rows=4)
    chunked = schedule not in SINGLE_CHUNK_SCHEDULES
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=num_micro_batches,
                                    schedule="1f1b" if chunked else schedule,
                                    activation_checkpoint=activation_checkpoint)
    pipeline = OpInterpreter(list(model()), llama_loss, lambda params: torch.optim.SGD(params, lr=0.1), config,
                             loss_count_fn=llama_count_tokens, schedule=schedule, virtual_stages=2 if chunked else 1)
    decision = pipeline.step(0, inputs, targets)

    net = model()
    predicted = sum(len(piece.tokens) - 1 for piece in pieces)
    loss = torch.stack([alone_loss(net, piece) for piece in pieces]).sum() / predicted
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in net.parameters()]))
    assert not decision.skipped
    torch.testing.assert_close(decision.loss, float(loss.detach()), rtol=1e-5, atol=0)
    torch.testing.assert_close(decision.grad_norm, float(norm), rtol=1e-5, atol=0)


def test_a_stage_reads_a_packed_dataset_and_weights_its_micro_batches_by_predicted_tokens(tmp_path, monkeypatch):
    """A one-stage worker reading a prepared packed dataset itself (as in fit): the step's
    loss is the mean over every predicted token of its micro-batches, whose counts differ."""
    import raypipe
    from raypipe.data import TokenDataset, prepare
    from raypipe.stage.spec import WorkerSpec
    from raypipe.stage.worker import StageWorker

    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    generator = random.Random(0)
    for index in range(30):
        (corpus / f"{index:02d}.txt").write_text("".join(generator.choice("abcdef") for _ in range(
            generator.choice([2, 5, 9, 40]))))
    data = TokenDataset(prepare(tmp_path / "data", corpus=corpus, seq_len=SEQ_LEN, val_fraction=0.0, pack=True),
                        micro_batch_size=2, num_micro_batches=2)
    config = CONFIG.replace(vocab_size=259)
    torch.manual_seed(0)
    layers = [layer.build() for layer in llama_layers(config)]
    spec = WorkerSpec(0, 1, tuple(layers), tuple(range(len(layers))), raypipe.PipelineConfig(
        num_stages=1, num_micro_batches=2), optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=llama_loss, loss_count_fn=llama_count_tokens)
    worker = StageWorker(spec)
    worker.attach_datasets(data)
    loss = sum(worker.forward(micro_batch, None, step=0) for micro_batch in range(2))
    for micro_batch in range(2):
        worker.backward(micro_batch)

    reference = torch.nn.Sequential(*(layer.build() for layer in llama_layers(config)))
    reference.load_state_dict(torch.nn.Sequential(*layers).state_dict())
    reference.zero_grad()
    parts = [data.get(0, micro_batch) for micro_batch in range(2)]
    counts = [llama_count_tokens(targets) for _, targets in parts]
    assert counts[0] != counts[1] and all(count < 2 * SEQ_LEN for count in counts)
    total = sum(F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum") for inputs, targets in parts) / sum(counts)
    total.backward()
    torch.testing.assert_close(loss, float(total.detach()), rtol=1e-5, atol=0)
    for got, expected in zip(torch.nn.Sequential(*layers).parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-7)
