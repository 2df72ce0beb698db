"""vLLM's disaggregated prefill as the router speaks it: which servers run a KV connector, and the two requests.

A vLLM server started with ``--kv-transfer-config`` runs a KV connector: a prefill server (role ``kv_producer``
or ``kv_both``) keeps a prompt's KV for another server, a decode server (``kv_consumer`` or ``kv_both``) takes
it instead of computing it. A split request is two requests, as vLLM's own proxy and vllm-router's
``--vllm-pd-disaggregation`` send them:

1. *prefill*, to the prefill server: the request with one output token, not streamed, and ``kv_transfer_params``
   asking for a remote decode. The server computes the prompt and its connector keeps the KV (NIXL holds the
   blocks for the decode server to pull; the example shared-storage connector writes them to its folder). Its
   answer's ``kv_transfer_params`` say where they are (the example connector returns none: the decode server
   finds the KV by the prompt's tokens).
2. *decode*, to the decode server: the request as the client sent it, with ``kv_transfer_params`` set to what
   the prefill answered.

A server without a connector takes ``kv_transfer_params`` and ignores them (it logs "no KVConnector found" and
computes the prompt itself), so the router finds out before it splits (``connector_of``): a decode server's
metrics carry ``vllm:num_requests_kv_fetch_by_stage`` only when it consumes KV, and ``/server_info`` (served
with ``VLLM_SERVER_DEV_MODE=1``) names the connector and its role.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Registered by a vLLM server only when its connector consumes KV (``kv_consumer``, ``kv_both``).
CONSUMER_METRIC = "vllm:num_requests_kv_fetch_by_stage"
PRODUCERS = ("kv_producer", "kv_both")
CONSUMERS = ("kv_consumer", "kv_both")
#: What a prefill request asks of the prefill server's connector.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
#: The flag that starts a vLLM server with the connector that runs on its CPU build.
EXAMPLE_FLAG = ("--kv-transfer-config '{\"kv_connector\": \"ExampleConnector\", \"kv_role\": \"kv_both\", "
                "\"kv_connector_extra_config\": {\"shared_storage_path\": DIR}}'")


@dataclass(frozen=True, slots=True)
class KvConnector:
    """The KV connector a vLLM server runs, as far as it says."""

    name: str | None
    """``ExampleConnector``, ``NixlConnector``, ... (``None``: not said: seen in the metrics only)."""
    role: str | None
    """``kv_producer``, ``kv_consumer`` or ``kv_both`` (``None``: not said; its metrics show it consumes)."""

    @property
    def produces(self) -> bool:
        """Whether it keeps a prompt's KV for another server (unknown roles are taken as ``kv_both``: a server
        that shows only its metrics consumes, and the connectors that run both ways are most)."""
        return self.role is None or self.role in PRODUCERS

    @property
    def consumes(self) -> bool:
        return self.role is None or self.role in CONSUMERS


def connector_of(server_info: dict | None, metric_names: set[str]) -> KvConnector | None:
    """The connector a server runs: from its ``/server_info?config_format=json`` (``None``: not served), else
    from the names of its metrics; ``None`` when it runs none."""
    if server_info is not None:
        config = (server_info.get("vllm_config") or {}).get("kv_transfer_config") or {}
        name = config.get("kv_connector")
        return None if name is None else KvConnector(str(name), config.get("kv_role"))
    return KvConnector(None, None) if CONSUMER_METRIC in metric_names else None


def prefill_fields(fields: dict) -> dict:
    """The client's fields as the prefill request sends them (one output token: ``Generation.max_tokens``)."""
    return {**fields, "kv_transfer_params": dict(PREFILL_PARAMS)}


def decode_fields(fields: dict, prefill_answer: dict) -> dict:
    """The client's fields as the decode request sends them: with what the prefill answered, if anything."""
    params = prefill_answer.get("kv_transfer_params")
    return fields if params is None else {**fields, "kv_transfer_params": params}
