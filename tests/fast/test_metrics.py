"""`GET /metrics`: the exposition parses with prometheus_client's own parser, and its
counters move as requests are served, refused and as children die and come back."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tests.fast.inprocess import ThreadLauncher, serving


async def _scrape(client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, by (name, sorted labels)."""
    answer = await client.get("/metrics")
    assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(await answer.text()) for sample in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_served_requests_move_the_counters():
    async def test():
        async with serving() as client:
            before = await _scrape(client)
            assert _value(before, "infinity_model_ready", model="m") == 1
            assert _value(before, "infinity_queue_slots", model="m") == 4096
            assert any(name == "infinity_build_info" for name, _ in before)
            # The engine that loaded it (the fast tier's fake), not the one configured.
            assert _value(before, "infinity_model_info", model="m", kind="embed", engine="fake", dtype="float32",
                          replicas="1") == 1
            texts = ["a short sentence", "another one " * 300]  # the second is cut at 256 tokens
            assert (await client.post("/v1/embeddings", json={"input": texts})).status == 200
            assert (await client.post("/v1/embeddings", json={"input": []})).status == 422
            assert (await client.post("/v1/embeddings", json={"model": "nope", "input": ["a"]})).status == 404
            assert (await client.get("/no/such/path")).status == 404
            after = await _scrape(client)
            route = "/v1/embeddings"
            assert _value(after, "infinity_requests_total", route=route, model="m", priority="0", status="200") == 1
            assert _value(after, "infinity_requests_total", route=route, model="m", priority="0", status="422") == 1
            assert _value(after, "infinity_requests_total", route=route, model="", priority="0", status="404") == 1
            assert _value(after, "infinity_requests_total", route="unmatched", model="", priority="", status="404") == 1
            assert _value(after, "infinity_request_duration_seconds_count", route=route, model="m", priority="0") == 2  # 200 and 422
            assert _value(after, "infinity_inputs_total", model="m") == 2
            assert _value(after, "infinity_prompt_tokens_total", model="m") > 256
            assert _value(after, "infinity_inputs_truncated_total", model="m") == 1
            assert _value(after, "infinity_queue_slots_in_use", model="m") == 0
            # The inference process's batches: both inputs, each waited once, in one pass or two.
            assert _value(after, "infinity_batch_size_sum", model="m") == 2
            assert _value(after, "infinity_queue_duration_seconds_count", model="m", priority="0") == 2
            passes = _value(after, "infinity_inference_duration_seconds_count", model="m")
            assert passes in (1, 2) and _value(after, "infinity_batch_tokens_count", model="m") == passes
            assert _value(after, "infinity_batch_tokens_sum", model="m") >= 256 + 3

    asyncio.run(test())


def test_slots_in_use_and_a_child_restart_show():
    launcher = ThreadLauncher()

    async def test():
        async with serving(launcher) as client:
            launcher.gate.clear()  # the fake engine holds every pass
            held = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": ["held", "by", "the child"]}))
            await asyncio.sleep(0.2)
            assert _value(await _scrape(client), "infinity_queue_slots_in_use", model="m") == 3
            launcher.processes["inference-cpu"].kill()
            assert (await held).status == 503
            launcher.gate.set()
            samples = await _scrape(client)
            assert _value(samples, "infinity_child_restarts_total", child="inference-cpu") == 1
            assert _value(samples, "infinity_child_restarts_total", child="tokenizer-0") == 0
            assert _value(samples, "infinity_queue_slots_in_use", model="m") == 0

    asyncio.run(test())


def test_metrics_need_no_api_key_and_count_the_refusals():
    async def test():
        async with serving(api_key="secret") as client:
            assert (await client.post("/v1/embeddings", json={"input": ["a"]})).status == 401
            samples = await _scrape(client)  # no Authorization header
            assert _value(samples, "infinity_requests_total", route="/v1/embeddings", model="", priority="", status="401") == 1

    asyncio.run(test())


def test_the_backlog_is_the_tokens_held_over_the_measured_rate():
    launcher = ThreadLauncher()

    async def test():
        async with serving(launcher) as client:
            launcher.gate.clear()
            held = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": ["a few words here"] * 4}))
            await asyncio.sleep(0.2)
            samples = await _scrape(client)
            queued = _value(samples, "infinity_queued_tokens", model="m")
            assert queued > 0
            assert _value(samples, "infinity_backlog_seconds", model="m") == 0  # no rate measured yet
            await asyncio.sleep(0.1)
            launcher.gate.set()
            assert (await held).status == 200
            samples = await _scrape(client)
            assert _value(samples, "infinity_queued_tokens", model="m") == 0
            assert _value(samples, "infinity_backlog_seconds", model="m") == 0
            launcher.gate.clear()
            held = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": ["a few words here"] * 4}))
            await asyncio.sleep(0.2)
            # The first request's tokens took at least 0.3 s: the same again is at least that much work.
            backlog = _value(await _scrape(client), "infinity_backlog_seconds", model="m")
            launcher.gate.set()
            assert (await held).status == 200
            assert backlog >= 0.25

    asyncio.run(test())


def test_the_token_rate_counts_busy_time_once_and_forgets_the_past():
    from infinity.client.topology import RATE_HALF_LIFE_S, TokenRate

    rate = TokenRate()
    assert rate.per_second is None
    rate.completed(100, sent=0.0, now=1.0)
    rate.completed(100, sent=0.5, now=1.5)  # overlapping the first: busy from 1.0 only
    assert abs(rate.per_second - 200 / 1.5) < 1  # (the first decayed by half a second's worth)
    rate.completed(1000, sent=1.5 + 10 * RATE_HALF_LIFE_S, now=2.5 + 10 * RATE_HALF_LIFE_S)
    assert 990 < rate.per_second < 1000  # the old figures weigh about a thousandth
