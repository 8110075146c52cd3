"""Where a patch node's post-run report goes: the run's history, the log, and the node's badge.

A patch node executes before the sampler, so the report of a sampling run exists only after the
node's own output has been handed to ComfyUI. ComfyUI (execution.py) keeps a node's UI output by
reference: in the output cache, in the prompt's ``/history/<prompt_id>`` entry ("outputs" ->
node id), and again in later prompts that reuse the cached node. The node therefore returns, under
``UI_KEY``, one record that it owns, ``{"status": <the node's check>, "runs": [...]}``, and every
sampling run that uses the patched model appends its report to ``runs`` as it ends, labelled with
the ``prompt_id`` and sampler node it ran in. An API client reads
``history[prompt_id]["outputs"][<patch node id>]["vc_attention"][0]["runs"]`` and takes the runs of
its own prompt (a prompt that reused every cached result has none: its outputs came from the
latest earlier run listed). The patch nodes declare ``has_intermediate_output``, so ComfyUI puts
this record into the history of every prompt that contains the node, executed or taken from the
cache. Entries are built whole before they are appended and no key is ever
added to a shared dict, so a concurrent read of the history (the server thread) sees a consistent
list.

While the run ends, the same entry goes to the front end as the websocket event ``EVENT`` (the
node's badge), and the text to the log; it is not sent as progress text, which ComfyUI would show
a second time under the node.
"""

from __future__ import annotations

import logging

log = logging.getLogger("vc_attention")

UI_KEY = "vc_attention"
EVENT = "vc_attention.report"
MAX_RUNS = 64  # runs kept per node execution (a node reused across many prompts)


class ReportChannel:
    """One patch node execution's reports: the record in its UI output, and what each run adds."""

    def __init__(self, node_id, status: str):
        self.node_id = None if node_id is None else str(node_id)
        self.record = {"status": status, "runs": []}

    def ui(self, text: str) -> dict:
        """The node's UI output: the text it shows, and the record runs are appended to."""
        return {"text": [text], UI_KEY: [self.record]}

    def publish(self, report) -> dict:
        """Append one finished run's report (engine.RunReport) and tell the front end."""
        prompt_id, sampler = _executing()
        entry = {"prompt_id": prompt_id, "sampler_node": sampler, **report.as_dict()}
        runs = self.record["runs"]
        runs.append(entry)
        del runs[:-MAX_RUNS]
        log.info("%s", entry["text"])
        _send(EVENT, {"node": self.node_id, **entry})
        return entry


def _executing():
    """(prompt id, node id) of the node ComfyUI is executing now (the sampler), or (None, None)."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None, None
    ctx = get_executing_context()
    return (None, None) if ctx is None else (ctx.prompt_id, ctx.node_id)


def _send(event: str, data: dict) -> None:
    """A websocket event to the front end (a no-op without a server, e.g. in scripts)."""
    try:
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is not None:
        server.send_sync(event, data, server.client_id)
