"""The deployment rehearsal behind `deploy/rehearse`: real systemd machines in network
namespaces, deployed by the real Ansible playbooks, loaded by the real driver.

One module per concern, each used only by the ones after it:

- `topology`: the machines, their groups, addresses, ports and names (no side effects);
- `proc`: running commands with a timeout, and the processes a run started;
- `network`: the namespaces, the bridge in a namespace of its own, the shaped links;
- `image`: the Debian base the machines boot from, built once and cached;
- `machines`: booting and halting the systemd-nspawn machines;
- `remote`: SSH, HTTP and Ansible from the controller namespace;
- `checks`: units, Prometheus targets, metrics scraped from the programs, the build a
  host runs, whether one machine reaches another's port;
- `builds`: the builds rolled out (the one under test, a second one, a broken one), each
  with its manifest;
- `load`: driver runs on the driver machines, their HDR logs and reports, the merge;
- `scenarios`: the firewall's check, a lost restart, the rollback of a broken build,
  check mode;
- `security`: mutual TLS's refusals (no certificate, plaintext, an identity the policy
  does not name) and the rotation of every certificate under load;
- `alerts`: the webhook receiver on the monitoring machine (`webhook.py`, a script run
  there), the alerts' settings, and an alert fired by a provider failing its calls,
  delivered firing, then resolved;
- `report`: the steps' outcomes and the figures, printed and as JSON.

`deploy/rehearse` is the command: it runs the steps in order and removes everything it
made, on success, failure or a signal.
"""
