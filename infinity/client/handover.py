"""Handing models served unprepared over to an inference process that loads them prepared.

An inference process whose models' conversions and trials are not in the cache yet serves
them at once, unprepared (`workers.inference.preparing`), and says so in `Ready`
(`ModelInfo.prepared`). The engine client then starts a preparing process on the same
cores; once it reports `Ready` (everything it made is in the cache) and exits, a successor
inference process starts and loads the models prepared. Until the successor is ready every
request goes to the serving process; once it is, new requests go to the successor, and the
serving process is stopped as soon as it holds none (`EngineClient._switch`).
"""

from __future__ import annotations

from dataclasses import dataclass

from infinity.client.supervisor import Child

PREPARING_ENTRY_POINT = "workers.inference.preparing:main"


@dataclass(eq=False)
class Handover:
    """One inference process's way from serving unprepared models to its successor."""

    serving: Child  # the inference process serving the models unprepared
    preparer: Child  # making their conversions and trials
    successor: Child | None = None  # loading them prepared, once the preparer is done

    @property
    def children(self) -> list[Child]:
        """The processes it started (those still to be stopped with the server)."""
        return [self.preparer] if self.successor is None else [self.preparer, self.successor]


def preparer_name(serving: Child) -> str:
    """The preparing process of the inference process `serving` ("prepare-cpu")."""
    return serving.name.replace("inference-", "prepare-", 1)


def successor_name(serving: Child) -> str:
    """The name of the inference process that takes over from `serving`: its own with the
    count of handovers behind it ("inference-cpu" -> "inference-cpu.1" -> ...)."""
    base, _, count = serving.name.partition(".")
    return f"{base}.{int(count or 0) + 1}"
