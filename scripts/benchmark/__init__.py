"""The benchmark behind `scripts/bench`: on 127.0.0.1, the broker against a direct
connection and against two L4 proxies (HAProxy and nginx's stream module), in front of
rpcmesh's provider and of the classic server, every process on the path accounted for; and
the same four paths with mutual TLS on every hop, in front of rpcmesh's provider.

One module per concern, each used only by the ones after it:

- `plan`: the paths, upstream kinds, roles, workloads, levels and durations (no side effects);
- `options`: the command line, validated into the settings of one run;
- `usage`: CPU time and context switches of a process, the children, the machine;
- `stalls`: the machine stall probe (every CPU kept busy by a clock-reading spinner);
- `certs`: the TLS paths' CA and certificates, issued by scripts/pki.py for each bench;
- `handshakes`: TLS handshakes per core-second of each TLS listener, and what each negotiates;
- `proxies`: finding HAProxy and nginx, their generated configurations (TLS frontends too);
- `servers`: the upstreams, brokers and proxies of the whole bench, started and stopped;
- `runs`: the driver's command line, the readiness probe, one measured run and its record;
- `schedule`: the interleaved order of the runs (the paths in turn within each repeat);
- `summary`: cells (medians over the repeats) and ratio rows (the paths against each other);
- `tables`: the reports' table rows and their drawing as text or Markdown;
- `targets`: the targets T1-T5, P1-P3, S1-S2 and their verdicts;
- `baseline`: the verdict on a baseline broker (--baseline-broker);
- `report`: the result document, written as JSON and Markdown and printed as text.

`scripts/bench` is the command: it runs these in order and stops every process it started,
on success, failure or a signal.
"""
