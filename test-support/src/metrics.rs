//! Reading a Prometheus text page (`GET /metrics`, [`crate::Service::metrics`]).

use std::collections::BTreeMap;

/// The value of the series `name` without labels on a Prometheus page (0 when absent: a gauge
/// not set yet).
pub fn sample(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .map_or(0.0, |v| v.parse().expect("a sample value"))
}

/// `credpool_allocations_total` of `provider` with `result` on a Prometheus page, summed over
/// its other labels (pools, tenants).
pub fn allocations(page: &str, provider: &str, result: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with("credpool_allocations_total{"))
        .filter(|l| {
            l.contains(&format!("provider=\"{provider}\""))
                && l.contains(&format!("result=\"{result}\""))
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

/// One series of a page: its name and its labels (name -> value).
pub type Series = (String, BTreeMap<String, String>);

/// Every sample of a Prometheus text page: (name, labels) -> value. Label values must hold no
/// commas or quotes (credpool's are bounded, known values).
pub fn samples(page: &str) -> BTreeMap<Series, f64> {
    let mut out = BTreeMap::new();
    for line in page
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => {
                let mut labels = BTreeMap::new();
                let rest = rest.strip_suffix('}').unwrap();
                for pair in rest.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once('=').unwrap();
                    labels.insert(k.to_owned(), v.trim_matches('"').to_owned());
                }
                (name.to_owned(), labels)
            }
            None => (series.to_owned(), BTreeMap::new()),
        };
        out.insert((name, labels), value);
    }
    out
}

/// Labels from (name, value) pairs, to look a series up in [`samples`].
pub fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
