//! The Ansible deployment of `deploy/ansible/` (issue 12) against the programs it deploys:
//! every `RPCMESH_` setting its environment templates write is one the program reads, the
//! group variables behind them hold the programs' defaults (unless their comment says why
//! not), every `rpcmesh_` variable the playbooks use is defined and documented in
//! `group_vars/`, the roles install the units `systemd_units` verifies, and the unit the
//! tuning role adds passes `systemd-analyze verify`.
//!
//! The playbooks themselves run for real in `deploy/ansible/test/run` (systemd-nspawn
//! machines) and are linted with `ansible-lint --profile production`; this test needs
//! neither Ansible nor root.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use rpcmesh_system_tests as system;
use rpcmesh_testkit as testkit;

const PROGRAMS: [&str; 3] = ["provider", "broker", "driver"];

/// The marker a group variable's comment carries when its value is not the program's
/// default on purpose (the comment then says why).
const NOT_THE_DEFAULT: &str = "(The program's default is";

fn ansible_dir() -> PathBuf {
    testkit::workspace_root().join("deploy/ansible")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `[env: KEY=]` and the `[default: VALUE]` that follows it, if any, from a `--help`.
fn help_settings(program: &str) -> BTreeMap<String, Option<String>> {
    let help = Command::new(testkit::bin_path(program))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    help.split("[env: ")
        .skip(1)
        .filter_map(|chunk| {
            let key = chunk.split(['=', ']']).next()?.to_string();
            let default = chunk
                .split_once("[default: ")
                .and_then(|(_, rest)| rest.split_once(']'))
                .map(|(value, _)| value.to_string());
            Some((key, default))
        })
        .collect()
}

/// One top-level variable of a group_vars file: its value as written (quotes removed;
/// None when the value continues on the next lines) and whether a comment documents it.
struct GroupVar {
    file: String,
    value: Option<String>,
    documented: bool,
    comment: String,
}

/// Every top-level `rpcmesh_...:` of group_vars/*.yml. A variable is documented when a
/// comment sits right above it.
fn group_vars() -> BTreeMap<String, GroupVar> {
    let mut vars = BTreeMap::new();
    let dir = ansible_dir().join("group_vars");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = read(&path);
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            if !name.starts_with("rpcmesh_") || name.contains(' ') {
                continue;
            }
            let value = value.trim();
            let value = match value {
                ">-" | ">" | "|" | "|-" | "" => None,
                v => Some(v.trim_matches('"').to_string()),
            };
            // The comment lines right above it.
            let mut comment: Vec<&str> = lines[..i]
                .iter()
                .rev()
                .take_while(|l| l.starts_with('#'))
                .copied()
                .collect();
            comment.reverse();
            vars.insert(
                name.to_string(),
                GroupVar {
                    file: file.clone(),
                    value,
                    documented: !comment.is_empty(),
                    comment: comment.join("\n"),
                },
            );
        }
    }
    vars
}

/// `(KEY, variable)` of every `setting('KEY', variable)` in a template, and every other
/// `KEY=` line's KEY with no variable.
fn template_settings(template: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for line in template.lines() {
        if let Some(rest) = line.trim().strip_prefix("{{ setting('") {
            let (key, rest) = rest.split_once("',").unwrap();
            let var = rest
                .trim()
                .trim_end_matches("}}")
                .trim()
                .trim_end_matches(')');
            out.push((key.to_string(), Some(var.trim().to_string())));
        } else if let Some((key, _)) = line.split_once('=') {
            if key.starts_with("RPCMESH_") && !key.contains(' ') {
                out.push((key.to_string(), None));
            }
        }
    }
    out
}

fn env_template(program: &str) -> String {
    read(&ansible_dir().join(format!("roles/{program}/templates/{program}.env.j2")))
}

#[test]
fn every_setting_the_environment_templates_write_is_read_by_its_program() {
    for program in PROGRAMS {
        let known = help_settings(program);
        let written = template_settings(&env_template(program));
        assert!(
            written.len() > 10,
            "{program}.env.j2: only {} settings found",
            written.len()
        );
        for (key, _) in written {
            assert!(
                known.contains_key(&key),
                "{program}.env.j2 writes {key}, which `{program} --help` does not list"
            );
        }
    }
}

#[test]
fn the_group_variables_hold_the_programs_defaults_unless_they_say_why_not() {
    let vars = group_vars();
    for program in PROGRAMS {
        let defaults = help_settings(program);
        for (key, var) in template_settings(&env_template(program)) {
            let Some(var) = var else { continue };
            if !var.starts_with("rpcmesh_") || var.contains(' ') {
                continue;
            }
            let gv = vars
                .get(&var)
                .unwrap_or_else(|| panic!("{program}.env.j2 uses {var}, not in group_vars"));
            let (Some(value), Some(Some(default))) = (&gv.value, defaults.get(&key)) else {
                continue;
            };
            if value.is_empty() || gv.comment.contains(NOT_THE_DEFAULT) {
                continue;
            }
            assert_eq!(
                value, default,
                "{}: {var} ({key}) is {value}, `{program} --help` says {default}; make them \
                 equal, or say why not in its comment (\"{NOT_THE_DEFAULT} ...\")",
                gv.file
            );
        }
    }
}

/// Every `rpcmesh_...` name in the text (a variable name: letters, digits, underscores).
fn variable_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("rpcmesh_") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            names.push(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, out);
        } else {
            out.push(path);
        }
    }
}

#[test]
fn every_variable_the_playbooks_use_is_defined_and_documented_in_group_vars() {
    let vars = group_vars();
    // Metric names (in the health checks' patterns and comments) are not variables.
    let metrics = variable_names(&read(&testkit::workspace_root().join("docs/metrics.md")));
    for (name, var) in &vars {
        assert!(var.documented, "{}: {name} has no comment", var.file);
    }
    let all = read(&ansible_dir().join("group_vars/all.yml"));
    let mut files = vec![
        ansible_dir().join("site.yml"),
        ansible_dir().join("rolling-restart.yml"),
        ansible_dir().join("rollback.yml"),
    ];
    files_under(&ansible_dir().join("roles"), &mut files);
    for path in files {
        let text = read(&path);
        for name in variable_names(&text) {
            // A family named by its prefix ("the rpcmesh_tuning_* variables"), or a metric.
            if name.ends_with('_') || metrics.contains(&name) {
                continue;
            }
            // rpcmesh_serial is a play keyword's value, given with -e (documented in a
            // comment of all.yml, as group variables cannot set it).
            if name == "rpcmesh_serial" {
                assert!(
                    all.contains("# rpcmesh_serial:"),
                    "rpcmesh_serial undocumented"
                );
                continue;
            }
            assert!(
                vars.contains_key(&name),
                "{} uses {name}, which group_vars/ does not define",
                path.display()
            );
        }
    }
}

#[test]
fn the_roles_install_the_units_of_deploy_systemd() {
    for program in PROGRAMS {
        let tasks = read(&ansible_dir().join(format!("roles/{program}/tasks/main.yml")));
        let unit = format!("rpcmesh-{program}.service");
        assert!(
            tasks.contains(&format!(
                "src: \"{{{{ rpcmesh_source_dir }}}}/deploy/systemd/{unit}\""
            )),
            "roles/{program} does not copy deploy/systemd/{unit}"
        );
        assert!(
            tasks.contains(&format!("dest: /etc/systemd/system/{unit}")),
            "roles/{program} does not install {unit}"
        );
        assert!(
            tasks.contains(&format!("dest: /etc/rpcmesh/{program}.env")),
            "roles/{program} does not write /etc/rpcmesh/{program}.env"
        );
    }
}

#[test]
fn systemd_analyze_verify_finds_nothing_in_the_rps_unit() {
    let files = ansible_dir().join("roles/tuning/files");
    let script = files.join("rpcmesh-rps");
    let unit = read(&files.join("rpcmesh-rps.service"));
    let dir = std::env::temp_dir().join(format!("rpcmesh-rps-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let env = dir.join("rps.env");
    std::fs::write(&env, "RPCMESH_RPS_CPUS=all\n").unwrap();
    let local = unit
        .replace("/usr/local/sbin/rpcmesh-rps", &script.display().to_string())
        .replace("/etc/rpcmesh/rps.env", &env.display().to_string());
    assert_ne!(
        local, unit,
        "the unit no longer names the script or its settings"
    );
    let path = dir.join("rpcmesh-rps.service");
    std::fs::write(&path, local).unwrap();
    system::systemd_analyze_verify(&path);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_group_variable_is_listed_in_the_deployment_guide() {
    let guide = read(&testkit::workspace_root().join("docs/deployment.md"));
    let missing: Vec<String> = group_vars()
        .into_iter()
        .filter(|(name, _)| !guide.contains(&format!("`{name}`")))
        .map(|(name, v)| format!("{name} ({})", v.file))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/deployment.md does not list: {missing:?}"
    );
}
