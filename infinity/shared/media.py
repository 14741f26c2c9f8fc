"""The medium each kind that sees or hears takes beside text: what `modality` a request
gives it, and which decoder and tower its items go to (workers/preprocess/media.py)."""

MEDIUM_OF_KIND = {"image_text": "image", "audio_text": "audio", "image_multivector": "image"}
# Kinds whose texts are encoded by the model's own processor (a prompt around the query,
# query augmentation) in the tokenizer processes, never by a plain tokenizer.
PROCESSOR_TEXT_KINDS = ("image_multivector",)
