"""Tiny random-weight models built at test time (no hub), saved in the layouts the server
reads: a WordPiece tokenizer trained on the fly, a small BERT encoder and its other
families (XLM-RoBERTa, MPNet), BERT sequence classifiers (a one-label cross-encoder and a
three-label text classifier) with the scoring server's models.toml, multi-vector (ColBERT)
and sparse (SPLADE) encoders, and the two-tower and page-retrieval models (CLIP, SigLIP,
CLAP, ColPali, ColQwen2), and decoder embedders (Qwen3-Embedding, gte-Qwen2)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches of jumbo sized vexing quartz sphinx numbers 0 1 2 3 4 5 6 7 8 9").split()


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                                         show_progress=False)
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tokenizer.train_from_iterator(corpus, trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tokenizer


def save_tiny_bert(folder: Path, seed: int = 0, max_positions: int = 64, tokenizer: Tokenizer | None = None) -> Path:
    """A 2-layer BERT with hidden size 32 and its tokenizer (by default `train_tokenizer`'s),
    in transformers layout."""
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or train_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=max_positions,
                        pad_token_id=0)
    torch.manual_seed(seed)
    BertModel(config).eval().save_pretrained(folder)
    return folder


# --- sequence-classification heads: a cross-encoder (one label) and a classifier ------------

CLASSIFIER_LABELS = ("negative", "neutral", "positive")


def save_hf_tokenizer(tokenizer: Tokenizer, folder: Path, model_max_length: int) -> None:
    """Save `tokenizer` as transformers does (tokenizer.json, tokenizer_config.json), so that
    AutoTokenizer, sentence-transformers' CrossEncoder and pipelines load it; BERT-style, it
    returns token_type_ids (the second text of a pair is segment 1)."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=model_max_length,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    ).save_pretrained(folder)


def save_tiny_sequence_classifier(folder: Path, labels: tuple[str, ...] | None, *, num_labels: int = 1,
                                  seed: int = 0, model_max_length: int = 512, max_positions: int = 512,
                                  init_range: float = 0.4) -> Path:
    """A 2-layer BERT (hidden size 32) with a sequence-classification head, random weights
    from `seed`, and a freshly trained WordPiece tokenizer, in plain transformers layout
    (config.json with `BertForSequenceClassification`, model.safetensors, tokenizer.json,
    tokenizer_config.json; no modules.json).

    `init_range` is far above BERT's 0.02 so that random logits spread over a few units
    rather than all sitting near 0. The tokenizer is trained anew on each call and its
    training is not deterministic: compare against the saved files, never a fresh one."""
    from transformers import BertConfig, BertForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    save_hf_tokenizer(tokenizer, folder, model_max_length)
    extra = {}
    if labels is not None:
        num_labels = len(labels)
        extra = {"id2label": dict(enumerate(labels)), "label2id": {label: i for i, label in enumerate(labels)}}
    config = BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=max_positions,
                        type_vocab_size=2, pad_token_id=0, num_labels=num_labels,
                        initializer_range=init_range, **extra)
    torch.manual_seed(seed)
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    return folder


def save_tiny_cross_encoder(folder: Path, seed: int = 0, model_max_length: int = 512) -> Path:
    """A one-label BERT cross-encoder (a reranker): what sentence-transformers'
    `CrossEncoder(folder)` loads, scoring with a sigmoid of the logit."""
    return save_tiny_sequence_classifier(folder, None, num_labels=1, seed=seed,
                                         model_max_length=model_max_length)


def save_tiny_classifier(folder: Path, seed: int = 1, labels: tuple[str, ...] = CLASSIFIER_LABELS,
                         model_max_length: int = 64) -> Path:
    """A BERT text classifier with `labels` (id2label in config.json), single-label
    multi-class: transformers' text-classification pipeline applies a softmax."""
    return save_tiny_sequence_classifier(folder, labels, seed=seed, model_max_length=model_max_length)


def assert_reranks_like_cross_encoder(server, model: str, folder: Path) -> None:
    """A few pairs served by `model` score as sentence-transformers' CrossEncoder scores
    them on the same folder."""
    import numpy as np
    from sentence_transformers import CrossEncoder

    query, documents = "the quick fox", ["a lazy dog", "quick brown fox jumps", "seven wizards judge boxing"]
    response = server.post("/v1/rerank", {"model": model, "query": query, "documents": documents})
    assert response.status_code == 200, response.text
    served = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
    expected = CrossEncoder(str(folder), device="cpu").predict([(query, d) for d in documents])
    np.testing.assert_allclose([served[i] for i in range(len(documents))], expected, atol=1e-5)


# --- one server for the scoring tests: the default embedder, a reranker, a classifier -------

RERANKER_NAME = "tiny-reranker"
CLASSIFIER_NAME = "tiny-classifier"
# The one-label cross-encoder again, served with kind = "classify" (overriding detection).
FORCED_CLASSIFIER_NAME = "tiny-reranker-as-classifier"
# The reranker's tokenizer says 512; models.toml cuts it to this. The classifier's
# tokenizer_config.json says this, and models.toml says nothing.
SCORING_MAX_LENGTH = 64
# Words the tiny tokenizer was trained on, and some it was not (word pieces, [UNK]).
SCORING_WORDS = tuple(WORDS) + ("Zürich", "café", "東京", "🙂", "don't", "3.14", "e-mail", "ranking",
                         "embedding", "search", "?", "!", "CamelCase")


def scoring_models_config(root: Path, embedder_name: str) -> str:
    """Build the tiny reranker and classifier under `root` and return a models.toml that
    serves them with the packaged default embedder (auto-detected kinds) and the reranker
    once more as a forced one-label classifier (the classifier is the default one for bodies
    that name no model: TEI's)."""
    reranker = save_tiny_cross_encoder(root / "reranker")
    classifier = save_tiny_classifier(root / "classifier", model_max_length=SCORING_MAX_LENGTH)
    return f"""
[[models]]
name = "{embedder_name}"
source = "default"

[[models]]
name = "{RERANKER_NAME}"
source = "{reranker}"
max_length = {SCORING_MAX_LENGTH}

[[models]]
name = "{CLASSIFIER_NAME}"
source = "{classifier}"
default = true

[[models]]
name = "{FORCED_CLASSIFIER_NAME}"
source = "{reranker}"
kind = "classify"
max_length = {SCORING_MAX_LENGTH}
"""


def scoring_text(rng, words: int) -> str:
    """`words` words drawn by `rng` (a random.Random) from SCORING_WORDS, some capitalised."""
    picked = [rng.choice(SCORING_WORDS) for _ in range(words)]
    return " ".join(w.capitalize() if rng.random() < 0.1 else w for w in picked)


# --- the encoder families every engine is checked on -----------------------------------------

FAMILIES = ("bert", "xlm-roberta", "mpnet")


def save_tiny_family_model(folder: Path, family: str, num_labels: int = 0, seed: int = 0) -> Path:
    """A 2-layer encoder of `family` (hidden size 32, vocabulary 200), random weights from
    `seed`: a plain encoder (an embedder) with `num_labels=0`, else with a
    sequence-classification head of that many labels, with the WordPiece tokenizer (engine
    tests feed token ids directly; converters read the vocabulary)."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    tokenizer = train_tokenizer()
    save_hf_tokenizer(tokenizer, folder, 64)
    pad = 0 if family == "bert" else 1
    config = AutoConfig.for_model(family, vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=66,
                                  pad_token_id=pad, initializer_range=0.4,
                                  **({"num_labels": num_labels} if num_labels else {}))
    torch.manual_seed(seed)
    model_class = AutoModelForSequenceClassification if num_labels else AutoModel
    model_class.from_config(config).eval().save_pretrained(folder)
    return folder


# --- multi-vector (ColBERT-style) --------------------------------------------------------------

def save_tiny_multivector(folder: Path, seed: int = 0, *, colbert: bool = False) -> Path:
    """sentence-transformers' own MultiVectorEncoder over a tiny BERT (Transformer ->
    Dense 32 -> 128 without bias -> MultiVectorMask -> Normalize), saved by it; the Dense
    layer starts random, so the saved folder is what is served and compared. With
    `colbert`, what classic ColBERT checkpoints set: [Q] / [D] prompts, a document length,
    queries expanded to 16 tokens with [MASK] the encoder does not attend to, a skiplist
    of document tokens (two common words: the tiny vocabulary has no punctuation), and
    meanmaxsim scoring."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    torch.manual_seed(seed)
    bert = save_tiny_bert(folder.with_name(folder.name + "-bert"), seed)
    if not colbert:
        MultiVectorEncoder(str(bert)).save(str(folder))
        return folder
    encoder = MultiVectorEncoder(str(bert), prompts={"query": "[Q] ", "document": "[D] "})
    encoder[0].document_length = 24
    encoder[0].query_expansion = {"strategy": "fixed", "attend": False, "length": 16}
    mask = next(module for module in encoder if isinstance(module, MultiVectorMask))
    mask.skiplist_words = ["the", "a"]
    encoder.similarity_fn_name = "meanmaxsim"  # MaxSim over the query's vectors, divided by their count
    encoder.save(str(folder))
    return folder


def save_tiny_pylate_colbert(folder: Path, seed: int = 0) -> Path:
    """A ColBERT in PyLate's layout from before sentence-transformers took it in
    (`model_type: "ColBERT"`): a Transformer and PyLate's Dense (32 -> 16) as modules, the
    [Q] / [D] prefixes added to the tokenizer as tokens (so the embedding table grows by
    two), lengths, expansion and skiplist at the top level of its settings."""
    import json

    from safetensors.torch import save_file
    from tokenizers import AddedToken

    tokenizer = train_tokenizer()
    tokenizer.add_tokens([AddedToken("[Q] ", normalized=True), AddedToken("[D] ", normalized=True)])
    save_tiny_bert(folder, seed, tokenizer=tokenizer)
    save_hf_tokenizer(tokenizer, folder, model_max_length=64)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({
        "model_type": "ColBERT", "query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 16,
        "document_length": 24, "attend_to_expansion_tokens": False, "skiplist_words": ["the", "a"],
        "similarity_fn_name": "MaxSim", "prompts": {}, "default_prompt_name": None}))
    (folder / "1_Dense").mkdir()
    (folder / "1_Dense" / "config.json").write_text(json.dumps({
        "in_features": 32, "out_features": 16, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity"}))
    torch.manual_seed(seed + 1)
    save_file({"linear.weight": torch.randn(16, 32)}, str(folder / "1_Dense" / "model.safetensors"))
    return folder


def save_tiny_stanford_colbert(folder: Path, seed: int = 0) -> Path:
    """A Stanford ColBERT checkpoint (`HF_ColBERT`): a BERT whose weights hold the
    projection (`linear.weight`, 32 -> 16) beside the encoder's (`bert.*`), settings in
    `artifact.metadata`, its [unused0] / [unused1] markers and punctuation plain
    entries of the WordPiece vocabulary (text would split the markers)."""
    import json

    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    vocabulary = tokenizer.get_vocab()
    for entry in ("[unused0]", "[unused1]", ".", ","):
        vocabulary[entry] = len(vocabulary)
    tokenizer.model = models.WordPiece(vocab=vocabulary, unk_token="[UNK]")
    save_hf_tokenizer(tokenizer, folder, model_max_length=64)
    config = BertConfig(vocab_size=len(vocabulary), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
                        architectures=["HF_ColBERT"])
    torch.manual_seed(seed)
    weights = {f"bert.{key}": value.contiguous() for key, value in BertModel(config).state_dict().items()}
    weights["linear.weight"] = torch.randn(16, 32)
    config.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "architectures": ["HF_ColBERT"]}))
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "artifact.metadata").write_text(json.dumps({
        "query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_maxlen": 16, "doc_maxlen": 24,
        "attend_to_mask_tokens": False, "mask_punctuation": True, "similarity": "cosine", "dim": 16}))
    return folder


# --- sparse (SPLADE) ---------------------------------------------------------------------------

def save_tiny_masked_lm(folder: Path, seed: int = 0) -> Path:
    """A 2-layer BERT masked language model (hidden size 32, the tiny WordPiece
    vocabulary), random weights from `seed`, in plain transformers layout
    (`BertForMaskedLM`, no modules.json). The weights are spread wider than BERT's
    (`initializer_range` 0.2) and the output bias is -1.5, so that, as in a real SPLADE
    model, relu keeps part of the vocabulary and zeroes the rest: a fifth to two thirds of
    the entries of an input are nonzero."""
    from transformers import BertConfig, BertForMaskedLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    save_hf_tokenizer(tokenizer, folder, 64)
    config = BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
                        initializer_range=0.2)
    torch.manual_seed(seed)
    model = BertForMaskedLM(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias.fill_(-1.5)
    model.save_pretrained(folder)
    return folder


def save_tiny_sparse(folder: Path, seed: int = 0, pooling: str = "max", activation: str = "relu",
                     max_active_dims: int | None = None, legacy_module: bool = False) -> Path:
    """sentence-transformers' own SparseEncoder over a tiny BERT masked language model
    (Transformer with the fill-mask task -> SpladePooling), saved by it. `legacy_module`:
    the transformer as sentence-transformers 5's `MLMTransformer` (the type name older
    SPLADE folders hold)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling, Transformer

    masked_lm = str(save_tiny_masked_lm(folder.with_name(folder.name + "-mlm"), seed))
    transformer = MLMTransformer(masked_lm) if legacy_module else Transformer(masked_lm, transformer_task="fill-mask")
    SparseEncoder(modules=[transformer, SpladePooling(pooling, activation)],
                  max_active_dims=max_active_dims).save(str(folder))
    return folder


# --- image-text (CLIP, SigLIP) -----------------------------------------------------------------

def save_inference_free_sparse(folder: Path, masked_lm: Path) -> Path:
    """An inference-free SPLADE as sentence-transformers builds one: a Router whose query
    route is a SparseStaticEmbedding (random positive weights, a few zero) and whose
    document route, the default, is the masked language model and SpladePooling."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import (Router, SparseStaticEmbedding, SpladePooling,
                                                              Transformer)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(masked_lm)
    generator = torch.Generator().manual_seed(3)
    weights = torch.rand(len(tokenizer.get_vocab()), generator=generator) * 3
    weights[::7] = 0
    router = Router.for_query_document(
        query_modules=[SparseStaticEmbedding(tokenizer, weight=weights)],
        document_modules=[Transformer(str(masked_lm), transformer_task="fill-mask"), SpladePooling("max")])
    SparseEncoder(modules=[router]).save(str(folder))
    return folder

def save_tiny_clip(folder: Path, seed: int = 0) -> Path:
    """A CLIP of two 2-layer towers (hidden 32, projection 16; 32x32 images in 8x8
    patches) over the tiny WordPiece tokenizer, whose [SEP] is the text tower's EOS (where
    CLIP pools), with its processor, saved by transformers."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = train_tokenizer()
    config = CLIPConfig(
        text_config={"vocab_size": tokenizer.get_vocab_size(), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 32,
                     "eos_token_id": tokenizer.token_to_id("[SEP]"), "bos_token_id": tokenizer.token_to_id("[CLS]"),
                     "pad_token_id": 0},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        projection_dim=16)
    torch.manual_seed(seed)
    CLIPModel(config).eval().save_pretrained(folder)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                  tokenizer=_fast_tokenizer(tokenizer, 32)).save_pretrained(folder)
    return folder


def save_tiny_siglip(folder: Path, seed: int = 0) -> Path:
    """A SigLIP of two 2-layer towers (hidden 32; texts of 16 positions, padded to all of
    them as SigLIP is trained; 32x32 images in 8x8 patches), with its processor."""
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipProcessor

    tokenizer = train_tokenizer()
    config = SiglipConfig(
        text_config={"vocab_size": tokenizer.get_vocab_size(), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 16,
                     "pad_token_id": 0, "eos_token_id": tokenizer.token_to_id("[SEP]")},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8})
    torch.manual_seed(seed)
    SiglipModel(config).eval().save_pretrained(folder)
    # As SigLIP's own tokenizer, it hands the model no attention mask: padding is attended to.
    SiglipProcessor(image_processor=SiglipImageProcessor(size={"height": 32, "width": 32}),
                    tokenizer=_fast_tokenizer(tokenizer, 16, ["input_ids"])).save_pretrained(folder)
    return folder


def _fast_tokenizer(tokenizer: Tokenizer, model_max_length: int,  # noqa: ANN202 (transformers stays lazy)
                    model_input_names: list[str] | None = None):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_max_length=model_max_length,
                                   **({"model_input_names": model_input_names} if model_input_names else {}))


# --- audio-text (CLAP) -------------------------------------------------------------------------

CLAP_SAMPLING_RATE = 8000


def save_tiny_clap(folder: Path, seed: int = 0, fusion: bool = False) -> Path:
    """A CLAP of a 2-layer text tower (hidden 32, 40 positions) and a 2-stage audio tower
    over 16-bin spectrograms of 1 s clips at 8 kHz, projections to 16; `fusion`: the fused
    variant (its feature extractor's `fusion` truncation, 4-channel inputs). Its [PAD] is
    the text tower's padding index, as CLAP's RoBERTa positions require."""
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor

    tokenizer = train_tokenizer()
    config = ClapConfig(
        text_config={"vocab_size": tokenizer.get_vocab_size(), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 40,
                     "projection_dim": 16, "pad_token_id": tokenizer.token_to_id("[PAD]"),
                     "bos_token_id": tokenizer.token_to_id("[CLS]"), "eos_token_id": tokenizer.token_to_id("[SEP]")},
        audio_config={"num_mel_bins": 16, "spec_size": 64, "window_size": 4, "patch_size": 4, "depths": [1, 1],
                      "num_attention_heads": [1, 2], "patch_embeds_hidden_size": 16, "hidden_size": 32,
                      "projection_dim": 16, "enable_fusion": fusion},
        projection_dim=16)
    torch.manual_seed(seed)
    ClapModel(config).eval().save_pretrained(folder)
    extractor = ClapFeatureExtractor(feature_size=16, sampling_rate=CLAP_SAMPLING_RATE, hop_length=160,
                                     max_length_s=1, fft_window_size=256, frequency_max=4000,
                                     truncation="fusion" if fusion else "rand_trunc")
    ClapProcessor(feature_extractor=extractor, tokenizer=_fast_tokenizer(tokenizer, 38)).save_pretrained(folder)
    return folder


# --- page retrieval (ColPali) ------------------------------------------------------------------

def save_tiny_colpali(folder: Path, seed: int = 0) -> Path:
    """A ColPali over a 2-layer Gemma (hidden 32) and a 2-layer SigLIP vision tower (32x32
    pages in 8x8 patches: 16 image tokens), vectors of 16, with its processor, saved by
    transformers. The processor is built first: it adds the image and location tokens,
    and the model's vocabulary must be the tokenizer's length."""
    from transformers import (ColPaliConfig, ColPaliForRetrieval, ColPaliProcessor, PaliGemmaConfig,
                              SiglipImageProcessor)

    image_processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    image_processor.image_seq_length = 16
    processor = ColPaliProcessor(image_processor=image_processor, tokenizer=_fast_tokenizer(train_tokenizer(), 512))
    vocabulary = len(processor.tokenizer)
    vlm = PaliGemmaConfig(
        text_config={"model_type": "gemma", "vocab_size": vocabulary, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
        image_token_index=processor.image_token_id, vocab_size=vocabulary, projection_dim=32, hidden_size=32)
    torch.manual_seed(seed)
    ColPaliForRetrieval(ColPaliConfig(vlm_config=vlm, embedding_dim=16)).eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>")


def train_qwen_tokenizer() -> Tokenizer:
    """A byte-level BPE (300 entries) with Qwen's special tokens, trained on the tiny words."""
    from tokenizers import decoders

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(QWEN_SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([" ".join(WORDS), "Question: describe the image"] * 4, trainer)
    return tokenizer


def save_tiny_colqwen2(folder: Path, seed: int = 0) -> Path:
    """A ColQwen2 over a 2-layer Qwen2-VL (hidden 32, multimodal rotary sections summing to
    half its head size) and a 1-block vision tower (14-pixel patches merged 2x2; images of
    56x56 to 112x112 pixels, so their token count varies with their size), vectors of 16,
    over a byte-level BPE with Qwen's special tokens, with its processor."""
    from transformers import (ColQwen2Config, ColQwen2ForRetrieval, ColQwen2Processor, PreTrainedTokenizerFast,
                              Qwen2VLConfig, Qwen2VLImageProcessor)

    tokenizer = train_qwen_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=512)
    fast.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    ids = {token: fast.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    processor = ColQwen2Processor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112),
                                  tokenizer=fast)
    vlm = Qwen2VLConfig(
        text_config={"vocab_size": len(fast), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "bos_token_id": None,
                     "eos_token_id": ids["<|endoftext|>"],
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        vocab_size=len(fast))
    torch.manual_seed(seed)
    ColQwen2ForRetrieval(ColQwen2Config(vlm_config=vlm, embedding_dim=16)).eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


# --- prompts: sentence-transformers folders that declare them ----------------------------------

def save_tiny_prompted_encoder(folder: Path, prompts: dict[str, str], default_prompt_name: str | None = None,
                               pooling: str = "mean", include_prompt: bool = True, seed: int = 0) -> Path:
    """sentence-transformers' SentenceTransformer over a tiny BERT (Transformer -> Pooling
    -> Normalize) with `prompts` and `default_prompt_name`, its Pooling of `pooling` and
    `include_prompt` (false: the prompt's tokens left out of it), saved by it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    bert = save_tiny_bert(folder.with_name(folder.name + "-bert"), seed)
    SentenceTransformer(modules=[Transformer(str(bert)), Pooling(32, pooling, include_prompt=include_prompt),
                                 Normalize()], prompts=prompts, default_prompt_name=default_prompt_name).save(str(folder))
    return folder


QWEN3_TINY_PROMPTS = {"query": "Instruct: Given a tiny query, find its passages\nQuery:", "document": ""}


def save_tiny_qwen3_embedder(folder: Path, seed: int = 0) -> Path:
    """Qwen3-Embedding's layout at a tiny size (`save_tiny_decoder_embedder`)."""
    return save_tiny_decoder_embedder(folder, "qwen3", seed)


def save_tiny_decoder_embedder(folder: Path, family: str, seed: int = 0) -> Path:
    """A decoder embedder's layout at a tiny size, Qwen3-Embedding's (`family` "qwen3"),
    gte-Qwen2's ("qwen2": with biases on its query, key and value projections, drawn at
    random here, where transformers starts them at zero) or e5-mistral's ("mistral"): a 2-layer decoder (hidden 32,
    4 query heads sharing 2 key-value heads), its byte-level BPE ending each text with
    <|endoftext|>, last-token pooling, normalised, and an instruction as its `query`
    prompt (`QWEN3_TINY_PROMPTS`), saved by sentence-transformers."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import (MistralConfig, MistralModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2Model,
                              Qwen3Config, Qwen3Model)

    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2Model), "qwen3": (Qwen3Config, Qwen3Model),
                                 "mistral": (MistralConfig, MistralModel)}[family]
    decoder = folder.with_name(folder.name + f"-{family}")
    tokenizer = train_qwen_tokenizer()
    end = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                             special_tokens=[("<|endoftext|>", end)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                            model_max_length=64).save_pretrained(decoder)
    config = config_class(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          max_position_embeddings=64, pad_token_id=end, eos_token_id=end)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(std=0.5)
    model.save_pretrained(decoder)
    SentenceTransformer(modules=[Transformer(str(decoder)), Pooling(32, "lasttoken"), Normalize()],
                        prompts=QWEN3_TINY_PROMPTS).save(str(folder))
    return folder


# --- decoder rerankers: a causal language model scored by its "yes" and "no" logits -------

# The tiny Qwen3-Reranker's template tokens: Qwen's chat markers and the empty reasoning block.
RERANKER_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# A chat template in sentence-transformers 6's shape for a causal CrossEncoder: the pair as
# messages of roles "query" and "document" (flat content), with an instruction of its own
# (so a served score that matches shows the folder's template was read, not the built-in one).
CAUSAL_RERANKER_CHAT_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: Given a tiny query, find the tiny documents\n"
    "<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') | first }}\n"
    "<Document>: {{ messages | selectattr('role', 'eq', 'document') | map(attribute='content') | first }}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def save_tiny_causal_reranker(folder: Path, seed: int = 0) -> Path:
    """Qwen3-Reranker's plain layout at a tiny size: a 2-layer Qwen3ForCausalLM (hidden 32,
    untied output layer), its byte-level BPE trained so that "yes" and "no" are single
    tokens, with Qwen's chat markers and think tags as special tokens; no modules.json.
    Name the folder like a Qwen3-Reranker ("Qwen3-Reranker-0.6B") for it to be recognised."""
    from tokenizers import decoders
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(RERANKER_SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([" ".join(WORDS), "yes", "no", "yes no"] * 8, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            model_max_length=512).save_pretrained(folder)
    config = Qwen3Config(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         pad_token_id=tokenizer.token_to_id("<|endoftext|>"),
                         eos_token_id=tokenizer.token_to_id("<|im_end|>"))
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    return folder


def save_tiny_logit_score_reranker(folder: Path, seed: int = 1) -> Path:
    """sentence-transformers 6's layout of a causal reranker: the tiny Qwen3ForCausalLM with
    `CAUSAL_RERANKER_CHAT_TEMPLATE`, loaded by `CrossEncoder` (which makes it a
    text-generation Transformer and LogitScore on "yes" and "no") and saved by it."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    plain = save_tiny_causal_reranker(folder.with_name(folder.name + "-causal-lm"), seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(str(plain))
    tokenizer.chat_template = CAUSAL_RERANKER_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(plain))
    CrossEncoder(str(plain), device="cpu").save(str(folder))
    return folder
