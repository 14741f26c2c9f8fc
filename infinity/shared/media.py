"""The medium each two-tower kind takes beside text: what `modality` a request gives it,
and which decoder and tower its items go to (workers/media_towers.py)."""

MEDIUM_OF_KIND = {"image_text": "image", "audio_text": "audio"}
