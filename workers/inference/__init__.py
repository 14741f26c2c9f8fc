"""The inference process (`worker`): the scheduler that cuts batches (`scheduler`), the
measurements at start that shape it (`calibration`), and the bfloat16 trial
(`precision`)."""
