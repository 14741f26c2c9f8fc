"""Which prompt a request's texts get: one rule, from its `prompt`, `prompt_name` and
`input_type` against its model's prompts (`ModelSpec.prompts`), for every route that
embeds texts and for `/tokenize`. What a model cannot honour is a 422 here, before
anything runs: a field the API takes either takes effect or is refused."""

from __future__ import annotations

import msgspec

from infinity.api.errors import APIError
from infinity.client.engine_client import ModelInputs
from infinity.client.topology import ServedModel

# The role of an input in the model's terms, by `input_type` (OpenAI-style and Cohere's
# names); "image" says only what Cohere's inputs are.
ROLES = {"query": "query", "search_query": "query", "document": "document", "search_document": "document",
         "classification": "classification", "clustering": "clustering", "image": None}


def with_prompt(model: ServedModel, inputs: ModelInputs, prompt: str | None, prompt_name: str | None,
                input_type: str | None) -> ModelInputs:
    """`inputs` with the prompt the request asks for put before each text: `prompt` as
    given, the model's prompt named `prompt_name`, or its prompt for `input_type`'s role;
    with none of them, the model's own for its task (left to the engine client,
    `ModelSpec.prompt_for`). `input_type` also says which side a model with tasks encodes
    them as (a query, or else a document). Token ids are embedded as they are: a prompt
    given or named with them is refused."""
    spec = model.spec
    role = ROLES[input_type] if input_type is not None else None
    if role is not None:
        inputs = msgspec.structs.replace(inputs, task="query" if role == "query" else "document",
                                         prompt=spec.prompt_for(role))
    if prompt is None and prompt_name is None:
        return inputs
    param = "prompt" if prompt is not None else "prompt_name"
    if prompt is not None and prompt_name is not None:
        raise APIError(422, "give prompt (the text itself) or prompt_name (one of the model's), not both",
                       param="prompt_name")
    if not model.kind.prompted:
        raise APIError(422, f"model '{spec.name}' of kind '{spec.kind}' takes no prompt; leave prompt and prompt_name "
                            "out", param=param)
    if inputs.texts is None:
        raise APIError(422, "a prompt goes before texts; these inputs are "
                            f"{'token ids, embedded as given' if inputs.token_ids is not None else 'media'}",
                       param=param)
    if prompt_name is not None and prompt_name not in spec.prompts:
        named = f"its prompts: {', '.join(spec.prompts)}" if spec.prompts else "it has none"
        raise APIError(422, f"model '{spec.name}' has no prompt named {prompt_name!r}; {named}", param="prompt_name")
    return msgspec.structs.replace(inputs, prompt=prompt if prompt is not None else spec.prompts[prompt_name])
