"""Byte-level GPT on Python's own standard library source (the a*.py to m*.py modules, about 1.8 MB).

    accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml recipes/gpt.py max_steps=300
    accel-trainer train gpt                      # 1 CPU process, about 3 minutes on 2 idle cores
    python recipes/gpt.py n_layer=2 d_model=64 max_steps=100

Expect eval bits per character (per byte; the source is nearly all ASCII) to fall from 7.6 at step 0 (8.0 is
a uniform guess over 256 bytes) to about 3.1 at step 200 and 2.3 after the default 600 steps (0.22 s a step
on 2 idle cores; Python 3.11's stdlib). `samples.txt` in the run folder holds what the trained model writes
after a few prompts: indented, Python-shaped text with made-up names.

Examples are paragraphs of source (split at blank lines) cut into chunks of at most block_size + 1 bytes,
so micro-batches hold different numbers of tokens: `compute_loss` returns `at.token_cross_entropy(...)`, the
summed loss with its token count, and the loop divides by the token count of the whole optimizer step, which
is exact on any layout. `pack_sequences=true` packs paragraphs into full windows instead (no padding; attention
and positions restart at each paragraph), and `streaming=true` streams the training text from the files
(datasets' streaming text loader), as a corpus larger than memory would be read. Each log record carries
`padded_per_token`: the positions that train nothing (padding, a packed window's paragraph starts) per trained
token. `data_cache_dir=<folder>` keeps the paragraphs, the split and the cut examples in datasets' Arrow cache
there: the main process builds them once, the other processes and later runs read them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
from torch import nn

import accel_trainer as at

PAD_ID = 256
"""Input id of padding: one past the 256 byte values. Padding is only ever at the end of a sequence."""
VOCAB_SIZE = 257
IGNORE_INDEX = -100
"""Target at padded positions; cross-entropy skips it."""


@dataclass
class ByteTextConfig(at.TrainConfig):
    """The training schedule and the data of the text recipes (this recipe, hf_causal_lm, hf_finetune): your text
    (data=) or the demo's paragraphs of the Python standard library, as bytes or a base's own tokens."""

    max_steps: int = 600
    global_batch_size: int = 32
    micro_batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    log_every_steps: int = 50
    eval_every_steps: int = 200
    block_size: int = 128
    """Longest context in tokens (bytes for the byte-level models); examples are cut to at most block_size + 1
    tokens (inputs plus the next token)."""
    pack_sequences: bool = False
    """Pack paragraphs back to back into windows of block_size + 1 tokens instead of padding each: every position
    trains, and attention and positions restart at each paragraph (a document mask; no context parallelism)."""
    streaming: bool = False
    """Stream the training paragraphs from the source files (a datasets IterableDataset, shuffled in a buffer of
    1,000, cut or packed on the fly); the eval paragraphs are chosen by a hash of their text in this mode."""
    pad_to_block_size: bool = False
    """Pad every batch to block_size, not to its longest sequence: one shape for every batch, which pipeline x
    FSDP layouts need (cpu_pp_fsdp.yaml); costs compute on the padding."""
    split_seed: int = 1234
    """Seed of the train/eval split of paragraphs, fixed so that runs with different seeds share one eval set."""
    eval_fraction: float = 0.05
    """Fraction of the paragraphs held out for evaluation."""
    max_source_bytes: int = 2_000_000
    """Cap on the corpus: the sorted source files are taken in order while their total size stays within it."""
    data_cache_dir: str = ""
    """A folder for datasets' Arrow cache of the paragraphs, the split and the cut or packed examples, reused by
    later runs (datasets' fingerprints: a change of block_size or split makes a new entry); the main process
    writes it first, the others read it. Empty: built in memory by each process, nothing kept."""
    data: str = ""
    """Your training text instead of the demo corpus: text files, folders or globs (.txt/.md, one row a paragraph),
    .jsonl/.json/.parquet/.csv (the text_column), a save_to_disk folder or a cached hub dataset id; a weighted
    mixture as a,b or a:0.7,b:0.3 (accel_trainer/data/sources.py). Empty: the demo corpus."""
    eval_data: str = ""
    """The held-out text, in data's forms; empty: eval_fraction of data is held out."""
    text_column: str = "text"
    """The column holding the text in .jsonl/.json/.parquet/.csv data, a save_to_disk folder or a hub dataset."""

    def __post_init__(self) -> None:
        self.data, self.eval_data = at.check_data(self.data, self.eval_data)


@dataclass
class GPTConfig(ByteTextConfig):
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    d_model: int = 128
    """Width of the residual stream (embedding size)."""
    dropout: float = 0.0
    """Dropout on attention weights and on each residual branch."""


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention, each position seeing only itself and earlier ones.

    Separate q, k and v projections (not one fused qkv) and shapes read from the projections' outputs with
    the head count left to `view`, so tensor parallelism can split the heads: under `tp_size=2` each process
    holds half of q, k and v's output features, that is half of the heads, and the same code runs.
    """

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        if d_model % n_head:
            raise at.ConfigError(f"d_model={d_model} is not a multiple of n_head={n_head}")
        self.n_head, self.head_dim = n_head, d_model // n_head  # n_head: tensor parallelism checks it divides
        self.dropout = dropout
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents` (batch, length): which packed paragraph each position belongs to; attention stays inside."""
        q, k, v = self.q(x), self.k(x), self.v(x)
        batch, length, _ = q.shape
        # (batch, length, heads * head_dim) -> (batch, heads, length, head_dim)
        q, k, v = (t.view(batch, length, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if documents is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:
            y = document_attention(q, k, v, documents, dropout)
        return self.proj(y.transpose(1, 2).reshape(batch, length, -1))


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor, dropout: float
) -> torch.Tensor:
    """Causal attention within each packed paragraph (`documents`: (batch, length) paragraph marks).

    On a GPU, flex_attention with a block mask: blocks wholly outside a paragraph are skipped and no (length x
    length) mask is made. On the CPU, and with attention dropout (which flex_attention lacks), SDPA with the dense
    (batch, 1, length, length) mask: torch 2.13's flex_attention has no backward on the CPU (canary:
    tests/test_gpt.py), so the CPU layouts are the GPU's twin through the same mask, not the same kernel.
    """
    if q.is_cuda and not dropout:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_paragraph_causal(b: Any, h: Any, query: Any, key: Any) -> Any:
            return (query >= key) & (documents[b, query] == documents[b, key])

        batch, length = documents.shape
        mask = create_block_mask(same_paragraph_causal, batch, None, length, length, device=documents.device)
        return _compiled_flex_attention()(q, k, v, block_mask=mask)
    length = documents.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril()
    mask = (documents[:, :, None] == documents[:, None, :]) & causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout)


@functools.cache
def _compiled_flex_attention() -> Any:
    """flex_attention compiled once per process: uncompiled, it materialises the whole score matrix."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(ln(x)), then x + MLP(ln(x)). The FSDP wrap unit."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_attention = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.ln_attention(x), documents))
        return x + self.dropout(self.mlp(self.ln_mlp(x)))


class GPT(nn.Module):
    """Decoder-only transformer over bytes with learned positions and an LM head tied to the token embedding."""

    def __init__(self, n_layer: int, n_head: int, d_model: int, block_size: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.token_embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_final = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.token_embedding.weight
        self.apply(_init_weights)
        # GPT-2's scaling of the residual output projections, so the residual stream does not grow with depth.
        for block in self.blocks:
            for projection in (block.attention.proj, block.mlp[2]):
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Logits of the next byte at every position, shape (batch, length, VOCAB_SIZE). `positions` (batch,
        length) numbers the tokens; given by the batch, so that context parallelism can slice it with them.
        `documents` (batch, length) marks packed paragraphs, which attend only within themselves."""
        length = input_ids.shape[1]
        if length > self.block_size:
            raise ValueError(f"a sequence of {length} tokens is longer than block_size={self.block_size}")
        if positions is None:
            positions = torch.arange(length, device=input_ids.device)[None]  # (1, length): sequence on dim 1
        x = self.dropout(self.token_embedding(input_ids) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x, documents)
        return self.lm_head(self.ln_final(x))


def _padded_length(length: int, block_size: int) -> int:
    """`length` rounded up to a multiple of 8, within block_size. Causal attention keeps the padding at the end
    from changing any real position, and its targets are ignored."""
    return min(-(-length // 8) * 8, max(length, block_size))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits for a batch (its paragraph marks only when packed: a pipeline traces the inputs given)."""
    inputs = [batch["input_ids"], batch["positions"]]
    return model(*inputs, batch["documents"]) if "documents" in batch else model(*inputs)


def token_losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy in nats at every position, zero at padding, and the mask of real targets; both (b, t)."""
    logits = forward(model, batch)
    targets = batch["targets"]
    losses = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return losses.view_as(targets), targets != IGNORE_INDEX


def source_files(max_source_bytes: int) -> list[str]:
    """The corpus files: top-level stdlib modules named a*.py to m*.py, sorted, within max_source_bytes.

    Only the stdlib folder itself is listed, not its subfolders (site-packages among them), so the selection
    depends on the Python version alone, never on what is installed.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = sorted(p for p in stdlib.glob("*.py") if "a" <= p.name[0] <= "m")  # no test*, no _private
    chosen, total = [], 0
    for path in candidates:
        total += path.stat().st_size
        if total > max_source_bytes:
            break
        chosen.append(str(path))
    if not chosen:
        raise at.ConfigError(
            f"max_source_bytes={max_source_bytes} is smaller than the first source file {candidates[0]}"
        )
    return chosen


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Hide datasets' progress bars while building (every process builds the same small corpus)."""
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def load_paragraphs(files: list[str], cache_dir: str = "") -> datasets.Dataset:
    """The files as a `datasets.Dataset` of paragraphs (text between blank lines), in file order.

    Without a `cache_dir`, built in a throwaway cache folder and kept in memory: each process builds it in well
    under a second, and nothing is left behind or shared between concurrent runs. With one, an Arrow table there,
    whose later maps and splits datasets caches beside it.
    """
    if cache_dir:
        return datasets.load_dataset("text", data_files=files, sample_by="paragraph", split="train",
                                     cache_dir=cache_dir)  # fmt: skip
    with tempfile.TemporaryDirectory() as throwaway:
        return datasets.load_dataset(
            "text", data_files=files, sample_by="paragraph", split="train", cache_dir=throwaway, keep_in_memory=True
        )


def utf8_bytes(texts: list[str]) -> list[list[int]]:
    """The byte-level models' tokens: each text's UTF-8 bytes."""
    return [list(text.encode("utf-8")) for text in texts]


class TokenizerEncoding:
    """A real tokenizer's tokens of each text, as the tokenizer adds its special tokens (a BOS for some), followed
    by its end-of-text token, so a model learns where a text ends. A class, not a closure: datasets hashes it for
    its cache fingerprints (by the tokenizer it holds)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def __call__(self, texts: list[str]) -> list[list[int]]:
        eos = self.tokenizer.eos_token_id
        return [ids + [eos] for ids in self.tokenizer(texts)["input_ids"]]


def chunk_paragraphs(
    batch: dict[str, list[str]], block_size: int, encode: Any = utf8_bytes
) -> dict[str, list[list[int]]]:
    """Cut each paragraph's tokens (`encode`: its UTF-8 bytes by default) into chunks of at most block_size + 1.

    Consecutive chunks overlap by one token, so every token after a paragraph's first is a target exactly once;
    a paragraph of one token has nothing to predict and is dropped.
    """
    chunks = []
    for data in encode(batch["text"]):
        chunks.extend(list(data[start : start + block_size + 1]) for start in range(0, len(data) - 1, block_size))
    return {"input_ids": chunks}


def pack_paragraphs(
    batch: dict[str, list[str]], block_size: int, encode: Any = utf8_bytes
) -> dict[str, list[list[int]]]:
    """Lay the paragraphs' tokens (`encode`: bytes by default) end to end and cut windows of block_size + 1
    tokens, each token marked with its paragraph (numbered from 0 in each window).

    Windows overlap by one token, as chunks do; the tokens after the last full window of a map batch (1,000
    paragraphs) are dropped. A paragraph's first token is never a target: its window restarts the context there.
    """
    ids: list[int] = []
    documents: list[int] = []
    for number, data in enumerate(encode(batch["text"])):
        ids.extend(data)
        documents.extend([number] * len(data))
    windows, marks = [], []
    for start in range(0, len(ids) - block_size, block_size):
        windows.append(ids[start : start + block_size + 1])
        marks.append([d - documents[start] for d in documents[start : start + block_size + 1]])
    return {"input_ids": windows, "documents": marks}


def is_eval_paragraph(row: dict[str, str], fraction: float, seed: int) -> bool:
    """A paragraph's side in streaming mode, fixed by its text: what a stream too large to hold can decide."""
    digest = hashlib.blake2b(f"{seed}:{row['text']}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def text_rows(cfg: ByteTextConfig, streaming: bool) -> Any:
    """The training text as rows of one column, "text": the user's `data=`, else the demo corpus's paragraphs."""
    if cfg.data:
        return at.read_data(cfg.data, [{"text": cfg.text_column}], streaming=streaming, seed=cfg.seed)
    files = source_files(cfg.max_source_bytes)
    if streaming:
        return datasets.load_dataset("text", data_files=files, sample_by="paragraph", split="train", streaming=True)
    return load_paragraphs(files, cfg.data_cache_dir)


def build_splits(cfg: ByteTextConfig, encode: Any = utf8_bytes) -> tuple[Any, datasets.Dataset]:
    """Train and eval examples, the text's tokens (`encode`) cut or packed; a held-out fraction is split off by
    paragraph (or row) first, so a paragraph's chunks stay on one side. `eval_data=` is the eval set instead."""
    cut = pack_paragraphs if cfg.pack_sequences else chunk_paragraphs
    options = dict(batched=True, fn_kwargs={"block_size": cfg.block_size, "encode": encode})
    with _quiet_datasets():
        if cfg.eval_data:
            held_out = at.read_data(cfg.eval_data, [{"text": cfg.text_column}], streaming=False, seed=cfg.seed)
            train = text_rows(cfg, cfg.streaming)
            if cfg.streaming:
                train = train.shuffle(seed=cfg.seed, buffer_size=1000)
            return _cut(train, cut, options), _cut(held_out, cut, options)
        if not cfg.streaming:
            splits = text_rows(cfg, streaming=False).train_test_split(test_size=cfg.eval_fraction, seed=cfg.split_seed)
            return _cut(splits["train"], cut, options), _cut(splits["test"], cut, options)
        side = {"fraction": cfg.eval_fraction, "seed": cfg.split_seed}
        eval_set = _cut(text_rows(cfg, streaming=False).filter(is_eval_paragraph, fn_kwargs=side), cut, options)
        stream = text_rows(cfg, streaming=True)
        train = stream.filter(lambda row: not is_eval_paragraph(row, **side)).shuffle(seed=cfg.seed, buffer_size=1000)
        return _cut(train, cut, options), eval_set


def _cut(rows: Any, cut: Any, options: dict[str, Any]) -> Any:
    """Rows of text as examples of tokens (every other column dropped); a held-out set (map-style) that yields none
    is refused."""
    examples = rows.map(cut, remove_columns=rows.column_names or ["text"], **options)
    if isinstance(examples, datasets.Dataset) and len(examples) == 0:
        block_size = options["fn_kwargs"]["block_size"]
        raise at.ConfigError(
            f"no example is left of {len(rows)} rows of text in windows of block_size={block_size} tokens (packed,"
            " a window must be filled; cut, a row needs two tokens): give more text (eval_data=, eval_fraction=)"
            " or lower block_size"
        )
    return examples


@at.register_recipe("gpt")
class ByteGPT(at.Recipe):
    """Byte-level GPT on Python standard library source, with variable-length sequences."""

    Config = GPTConfig
    wrap_classes = (Block,)
    sequence_dims = {"input_ids": 1, "targets": 1, "positions": 1}  # what context parallelism slices
    tp_plan = {
        # Megatron-style: vocabulary-parallel embeddings, column- then row-parallel attention and MLP, and the
        # activations between them sharded along the sequence (sequence parallelism); the LM head's logits are
        # gathered for the loss. The head stays tied to the token embedding (both split along the vocabulary).
        "token_embedding": "embedding",
        "position_embedding": "embedding",
        "blocks.*.ln_attention": "sequence_parallel",
        "blocks.*.attention.q": "colwise",
        "blocks.*.attention.k": "colwise",
        "blocks.*.attention.v": "colwise",
        "blocks.*.attention.proj": "rowwise",
        "blocks.*.ln_mlp": "sequence_parallel",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
        "ln_final": "sequence_parallel",
        "lm_head": "colwise_gather_output",
    }

    @property
    def pad_id(self) -> int:
        """The input id at padded positions (a real tokenizer's recipe gives its padding token's)."""
        return PAD_ID

    def build_model(self, cfg: GPTConfig) -> nn.Module:
        return GPT(cfg.n_layer, cfg.n_head, cfg.d_model, cfg.block_size, cfg.dropout)

    def build_datasets(self, cfg: GPTConfig) -> tuple[datasets.Dataset, datasets.Dataset]:
        return build_splits(cfg)

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Pad to the longest sequence of the batch, rounded up to a multiple of 8: inputs with `pad_id`, targets
        with IGNORE_INDEX (sequence and context parallelism split the length evenly over up to 8 and 4
        processes); positions 0..length-1 for every row. Packed windows: see `collate_packed`."""
        if "documents" in examples[0]:
            return collate_packed(examples)
        sequences = [torch.as_tensor(example["input_ids"], dtype=torch.long) for example in examples]
        longest = self.cfg.block_size if self.cfg.pad_to_block_size else max(len(s) for s in sequences) - 1
        length = _padded_length(longest, self.cfg.block_size)
        input_ids = torch.full((len(sequences), length), self.pad_id, dtype=torch.long)
        targets = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, : len(sequence) - 1] = sequence[:-1]
            targets[row, : len(sequence) - 1] = sequence[1:]
        positions = torch.arange(length).repeat(len(sequences), 1)
        return {"input_ids": input_ids, "targets": targets, "positions": positions}

    def compute_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        loss = at.token_cross_entropy(forward(model, batch), batch["targets"], IGNORE_INDEX)
        return {**loss, "padded_per_token": (batch["targets"] == IGNORE_INDEX).sum()}

    def eval_metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-sequence sums with their token counts: the loop reports total loss over total tokens."""
        losses, mask = token_losses(model, batch)
        loss, tokens = losses.sum(dim=1), mask.sum(dim=1)
        return {"loss": (loss, tokens), "bits_per_char": (loss / math.log(2), tokens)}

    def write_artifacts(self, model: nn.Module, eval_dataset: datasets.Dataset, run_dir: Path) -> None:
        """Save `samples.txt`: what the model writes (sampled, fixed seed) after a few Python prompts."""
        generator = torch.Generator().manual_seed(self.cfg.seed)
        prompts = ["def ", "class ", "import ", "    if "]
        samples = [generate(model, prompt, num_bytes=300, generator=generator) for prompt in prompts]
        (run_dir / "samples.txt").write_text("\n\n----------\n\n".join(samples) + "\n")


def collate_packed(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Packed windows of block_size + 1 bytes: inputs and targets shifted by one, a target in another paragraph
    than its input ignored, positions counted from each paragraph's start, paragraph marks for attention."""
    ids = torch.stack([torch.as_tensor(example["input_ids"], dtype=torch.long) for example in examples])
    marks = torch.stack([torch.as_tensor(example["documents"], dtype=torch.long) for example in examples])
    documents = marks[:, :-1]
    targets = torch.where(marks[:, 1:] == documents, ids[:, 1:], IGNORE_INDEX)
    index = torch.arange(documents.shape[1]).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    positions = index - torch.where(starts, index, 0).cummax(dim=1).values
    return {"input_ids": ids[:, :-1], "targets": targets, "positions": positions, "documents": documents}


@torch.no_grad()
def generate(model: GPT, prompt: str, num_bytes: int, generator: torch.Generator, temperature: float = 0.8) -> str:
    """Continue `prompt` by sampling `num_bytes` bytes, the context cut to the model's block size."""
    ids = list(prompt.encode("utf-8"))
    for _ in range(num_bytes):
        context = torch.tensor([ids[-model.block_size :]])
        logits = model(context)[0, -1, :PAD_ID].float()  # never sample padding
        probabilities = torch.softmax(logits / temperature, dim=-1)
        ids.append(int(torch.multinomial(probabilities, 1, generator=generator)))
    return bytes(ids).decode("utf-8", errors="replace")


if __name__ == "__main__":
    at.main("gpt")
