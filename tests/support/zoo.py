"""The model zoo: a tiny random-weight folder for each shape of model users deploy, saved
the way the hub publishes the family (sentence-transformers' own save of its module chain,
or transformers' for a cross-encoder or classifier), each held to the reference library
on the same weights by tests/e2e/engines/test_model_zoo.py.

`EMBEDDERS` and `SCORERS` map a zoo name to the function that builds its folder; every
encoder is 2 layers of width 32 (an EmbeddingGemma's two Dense modules 32 -> 128 -> 32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import processors

from tests.support.modernbert import save_tiny_modernbert_embedder
from tests.support.tiny_models import (save_hf_tokenizer, save_tiny_decoder_embedder, save_tiny_family_model,
                                       train_qwen_tokenizer, train_tokenizer)

WIDTH = 32
# Each family's config for a 2-layer encoder of WIDTH, in the keys it names them by.
_ENCODER_CONFIGS = {
    "bert": dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=66),
    "mpnet": dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=66, pad_token_id=1),
    "roberta": dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=66, pad_token_id=1),
    "xlm-roberta": dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=66, pad_token_id=1),
    "nomic_bert": dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       head_dim=16, max_position_embeddings=66),
    "gte": dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=66, pad_token_id=0),
    "distilbert": dict(dim=WIDTH, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=66),
    "t5": dict(d_model=WIDTH, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
               decoder_start_token_id=0, pad_token_id=0, feed_forward_proj="gated-gelu"),
}


def _encoder(folder: Path, family: str, seed: int = 0) -> Path:
    """A 2-layer encoder of `family` (its base model: T5's encoder alone, as sentence-T5
    and GTR publish it) with the WordPiece tokenizer, random weights spread wide."""
    from transformers import AutoConfig, AutoModel, T5EncoderModel

    tokenizer = train_tokenizer()
    save_hf_tokenizer(tokenizer, folder, 64)
    config = AutoConfig.for_model(family, vocab_size=tokenizer.get_vocab_size(), initializer_range=0.4,
                                  **_ENCODER_CONFIGS[family])
    torch.manual_seed(seed)
    model = (T5EncoderModel(config) if family == "t5" else AutoModel.from_config(config)).eval()
    model.save_pretrained(folder)
    return folder


def _st(folder: Path, encoder: Path, after: list, prompts: dict[str, str] | None = None) -> Path:
    """sentence-transformers' save of Transformer(encoder) followed by the modules `after`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer

    SentenceTransformer(modules=[Transformer(str(encoder)), *after], prompts=prompts).save(str(folder))
    return folder


def _pooling(*modes: str, include_prompt: bool = True):  # noqa: ANN202 (sentence-transformers stays lazy)
    from sentence_transformers.sentence_transformer.modules import Pooling

    return Pooling(WIDTH, modes[0] if len(modes) == 1 else modes, include_prompt=include_prompt)


def _dense(in_features: int, out_features: int, activation: torch.nn.Module | None = None, bias: bool = True,
           residual: bool = False, on_tokens: bool = False):  # noqa: ANN202
    from sentence_transformers.base.modules import Dense

    dense = Dense(in_features, out_features, bias=bias, activation_function=activation, use_residual=residual,
                  module_input_name="token_embeddings" if on_tokens else "sentence_embedding")
    with torch.no_grad():
        for parameter in dense.parameters():
            parameter.normal_(std=0.3)
    return dense


def _normalize():  # noqa: ANN202
    from sentence_transformers.base.modules import Normalize

    return Normalize()


def _layer_norm(dimension: int):  # noqa: ANN202
    from sentence_transformers.sentence_transformer.modules import LayerNorm

    norm = LayerNorm(dimension)
    with torch.no_grad():
        norm.norm.weight.normal_(1.0, 0.3)
        norm.norm.bias.normal_(0.0, 0.3)
    return norm


def _family(family: str, *after_factories: Callable, prompts: dict[str, str] | None = None
            ) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        torch.manual_seed(1)
        return _st(folder, _encoder(folder.with_name(folder.name + "-encoder"), family),
                   [make() for make in after_factories], prompts)
    return build


def save_embedding_gemma(folder: Path, seed: int = 0) -> Path:
    """EmbeddingGemma's layout: a bidirectional Gemma3 text model (its tokenizer putting
    <bos> before a text and <eos> after it), mean pooling, Dense up to four times the
    width and back down (no bias, identity), Normalize, and its task prompts."""
    from transformers import Gemma3TextConfig, Gemma3TextModel, PreTrainedTokenizerFast

    encoder = folder.with_name(folder.name + "-gemma3")
    tokenizer = train_qwen_tokenizer()
    bos, eos = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|endoftext|>", special_tokens=[("<|im_start|>", bos), ("<|endoftext|>", eos)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>", model_max_length=64).save_pretrained(encoder)
    config = Gemma3TextConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=WIDTH, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              query_pre_attn_scalar=16, max_position_embeddings=64, sliding_window=4,
                              use_bidirectional_attention=True, pad_token_id=eos, bos_token_id=bos, eos_token_id=eos,
                              initializer_range=0.2)
    torch.manual_seed(seed)
    Gemma3TextModel(config).eval().save_pretrained(encoder)
    prompts = {"query": "task: search result | query: ", "document": "title: none | text: ",
               "Clustering": "task: clustering | query: "}
    return _st(folder, encoder, [_pooling("mean"), _dense(WIDTH, 4 * WIDTH, bias=False),
                                 _dense(4 * WIDTH, WIDTH, bias=False), _normalize()], prompts)


def save_static_embedder(folder: Path, seed: int = 0, model2vec: bool = False) -> Path:
    """A StaticEmbedding (model2vec's potion layout) over the WordPiece tokenizer, whose
    tokenizer.json adds [CLS] and [SEP] (sentence-transformers encodes without them), then
    Normalize. With `model2vec`, its weights as model2vec saves a quantised vocabulary: a
    smaller `embeddings` table, each token's row in `mapping` and its `weights`."""
    import json

    from safetensors.torch import save_file
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    tokenizer = train_tokenizer()
    torch.manual_seed(seed)
    static = StaticEmbedding(tokenizer, embedding_weights=torch.randn(tokenizer.get_vocab_size(), WIDTH))
    SentenceTransformer(modules=[static, _normalize()]).save(str(folder))
    if model2vec:
        module = folder / json.loads((folder / "modules.json").read_text())[0]["path"]
        vocabulary = tokenizer.get_vocab_size()
        save_file({"embeddings": torch.randn(50, WIDTH), "mapping": torch.randint(0, 50, (vocabulary,)),
                   "weights": torch.rand(vocabulary) + 0.5}, str(module / "model.safetensors"))
    return folder


def save_mistral_embedder(folder: Path, seed: int = 0) -> Path:
    """A Mistral decoder with last-token pooling (e5-mistral's and SFR's layout)."""
    return save_tiny_decoder_embedder(folder, "mistral", seed)


# Embedders: each served and held to sentence-transformers' SentenceTransformer.encode.
EMBEDDERS: dict[str, Callable[[Path], Path]] = {
    "bert-cls": _family("bert", lambda: _pooling("cls"), _normalize),
    "bert-weightedmean-unnormalised": _family("bert", lambda: _pooling("weightedmean")),
    "bert-max": _family("bert", lambda: _pooling("max"), _normalize),
    "bert-cls-mean-sqrt": _family("bert", lambda: _pooling("cls", "mean_sqrt_len_tokens")),
    # LaBSE's and the first sentence-transformers models' shape: a Dense with Tanh and a bias.
    "bert-dense-tanh": _family("bert", lambda: _pooling("cls"), lambda: _dense(WIDTH, 24, torch.nn.Tanh()),
                               _normalize),
    "bert-dense-gelu-layernorm": _family("bert", lambda: _pooling("mean"), lambda: _dense(WIDTH, 48, torch.nn.GELU()),
                                         lambda: _dense(48, 16, torch.nn.SiLU(), bias=False), lambda: _layer_norm(16),
                                         _normalize),
    # A Dense over each token's state, before pooling.
    "bert-dense-on-tokens": _family("bert", lambda: _dense(WIDTH, 16, torch.nn.Tanh(), on_tokens=True),
                                    lambda: _pooling("mean"), _normalize),
    "bert-dense-residual": _family("bert", lambda: _pooling("mean"), lambda: _dense(WIDTH, 16, residual=True)),
    "bert-prompt-left-out": _family("bert", lambda: _pooling("mean", include_prompt=False), _normalize,
                                    prompts={"query": "quick fox: ", "document": ""}),
    "mpnet-mean": _family("mpnet", lambda: _pooling("mean"), _normalize),
    "roberta-mean": _family("roberta", lambda: _pooling("mean"), _normalize),
    "xlm-roberta-mean": _family("xlm-roberta", lambda: _pooling("mean"), _normalize),
    "modernbert-cls": lambda folder: save_tiny_modernbert_embedder(folder, "cls"),
    "distilbert-mean": _family("distilbert", lambda: _pooling("mean")),
    "nomic-bert-mean": _family("nomic_bert", lambda: _pooling("mean"), _normalize,
                               prompts={"query": "search_query: ", "document": "search_document: "}),
    "gte-cls": _family("gte", lambda: _pooling("cls"), _normalize),
    "sentence-t5": _family("t5", lambda: _pooling("mean"), lambda: _dense(WIDTH, WIDTH, bias=False), _normalize),
    "embeddinggemma": save_embedding_gemma,
    "mistral-lasttoken": save_mistral_embedder,
    "qwen3-lasttoken": lambda folder: save_tiny_decoder_embedder(folder, "qwen3"),
    "static-embedding": save_static_embedder,
    "model2vec": lambda folder: save_static_embedder(folder, model2vec=True),
}
# The engine each is served on in the zoo's server where it is not torch.
ENGINES = {"static-embedding": "static", "model2vec": "static"}
# The prompt each embedder's queries are sent with in the test (none: no prompt).
EMBEDDER_PROMPTS = {"bert-prompt-left-out": "query", "nomic-bert-mean": "query", "embeddinggemma": "query",
                    "qwen3-lasttoken": "query"}


def _family_scorer(family: str, num_labels: int) -> Callable[[Path], Path]:
    return lambda folder: save_tiny_family_model(folder, family, num_labels=num_labels)


def save_raw_score_cross_encoder(folder: Path) -> Path:
    """A BERT cross-encoder saved by sentence-transformers 6 with the identity as its
    activation (config_sentence_transformers.json's `activation_fn`): its scores are logits."""
    from sentence_transformers import CrossEncoder

    encoder = save_tiny_family_model(folder.with_name(folder.name + "-bert"), "bert", num_labels=1)
    CrossEncoder(str(encoder), activation_fn=torch.nn.Identity()).save(str(folder))
    return folder


# Cross-encoders and classifiers: held to sentence-transformers' CrossEncoder.predict.
SCORERS: dict[str, Callable[[Path], Path]] = {
    "bert-cross-encoder": _family_scorer("bert", 1),
    "bert-cross-encoder-logits": save_raw_score_cross_encoder,
    "xlm-roberta-cross-encoder": _family_scorer("xlm-roberta", 1),
    "deberta-v2-cross-encoder": _family_scorer("deberta-v2", 1),
    "electra-cross-encoder": _family_scorer("electra", 1),
    "distilbert-classifier": _family_scorer("distilbert", 3),
}
