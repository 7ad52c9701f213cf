//! docs/metrics.md's label table names every label of the metric catalogue, and no other,
//! and lists the values the code gives the labels whose values are an enum's.

use std::collections::BTreeSet;

use rpcmesh_common::metrics::catalogue::CATALOGUE;
use rpcmesh_common::metrics::errors::Side;
use rpcmesh_common::metrics::families::ShedCap;
use rpcmesh_common::net::connection::CloseReason;
use rpcmesh_wire::status::Status;

/// The label table's rows: the labels a row is about (its first cell's code spans), and
/// its values cell.
fn label_rows() -> Vec<(Vec<String>, String)> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"))
        .expect("docs/metrics.md");
    let start = doc
        .find("\n## Labels\n")
        .expect("docs/metrics.md has a section Labels");
    doc[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let labels = cells[1]
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect();
            (labels, cells[2].to_string())
        })
        .collect()
}

#[test]
fn the_metrics_doc_names_every_label_of_the_catalogue_and_no_other() {
    let documented: BTreeSet<String> = label_rows().into_iter().flat_map(|(l, _)| l).collect();
    let catalogued: BTreeSet<String> = CATALOGUE
        .iter()
        .flat_map(|f| f.labels.iter().map(|l| l.to_string()))
        .collect();
    let missing: Vec<_> = catalogued.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&catalogued).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/metrics.md's label table lacks {missing:?} and names {extra:?}, which no family has"
    );
}

#[test]
fn the_metrics_doc_lists_the_values_of_the_enum_labels() {
    let rows = label_rows();
    let values = |label: &str| {
        rows.iter()
            .find(|(labels, _)| labels.iter().any(|l| l == label))
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("docs/metrics.md's label table has no row for {label}"))
    };
    let expect = |label: &str, words: Vec<&str>| {
        let cell = values(label);
        let missing: Vec<_> = words
            .into_iter()
            .filter(|w| !cell.contains(&format!("`{w}`")))
            .collect();
        assert!(
            missing.is_empty(),
            "docs/metrics.md: the {label} row does not list {missing:?}"
        );
    };
    expect(
        "reason",
        CloseReason::ALL.iter().map(|r| r.label()).collect(),
    );
    expect("side", Side::ALL.iter().map(|s| s.label()).collect());
    expect("cap", ShedCap::ALL.iter().map(|c| c.label()).collect());
    expect("status", Status::ALL.iter().map(|s| s.label()).collect());
}
