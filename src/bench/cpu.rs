//! CPU time per process group from `/proc` (Linux), so a run can say where each cycle's CPU went:
//! the service, PostgreSQL, Redis and this load generator, each as `utime + stime` over the
//! measured window divided by the cycles completed in it.
//!
//! Processes are told apart by their command name: `postgres` (the postmaster, every backend and
//! the background processes: the sum is the server's whole cost), `redis-server`, and `credpool`
//! other than this process (every service process on the machine, replicas included). A process
//! that exits during the window takes its CPU time with it; the service's and the baselines'
//! connections stay open for a whole run, so their backends are counted. Elsewhere than Linux
//! nothing is read.

/// Clock ticks per second of `/proc/<pid>/stat`'s `utime` and `stime`: USER_HZ, which Linux
/// exports to user space as 100 on every architecture it supports today.
const TICKS_PER_SECOND: f64 = 100.0;

/// CPU seconds per group at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuReading {
    service: f64,
    postgres: f64,
    redis: f64,
    generator: f64,
}

/// Microseconds of CPU per completed cycle, per group, over a window.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct CpuPerCycle {
    /// Service processes (`credpool serve`), when the service runs apart from the generator.
    pub service_us: Option<f64>,
    /// Every `postgres` process.
    pub postgres_us: f64,
    /// Every `redis-server` process.
    pub redis_us: f64,
    /// This process: the load generator (and, for an in-process service, the service too).
    pub generator_us: f64,
}

/// Reads every process's CPU time now; `None` where `/proc` cannot be read.
pub fn read() -> Option<CpuReading> {
    let own = std::process::id();
    let mut reading = CpuReading::default();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue; // exited meanwhile
        };
        let Some((comm, seconds)) = parse_stat(&stat) else {
            continue;
        };
        match comm {
            _ if pid == own => reading.generator += seconds,
            "postgres" => reading.postgres += seconds,
            "redis-server" => reading.redis += seconds,
            "credpool" => reading.service += seconds,
            _ => {}
        }
    }
    Some(reading)
}

/// The command name and `utime + stime` in seconds of one `/proc/<pid>/stat` line. The name
/// sits in parentheses and may itself contain spaces and parentheses: the fields after it start
/// after the LAST `)`.
fn parse_stat(stat: &str) -> Option<(&str, f64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?;
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    // fields[0] is the state (field 3 of proc(5)); utime and stime are fields 14 and 15
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((comm, (utime + stime) / TICKS_PER_SECOND))
}

/// The CPU per cycle between two readings, for `cycles` completed cycles; `separate_service`:
/// the service runs in processes of its own (else its time is in the generator's).
pub fn per_cycle(
    before: CpuReading,
    after: CpuReading,
    cycles: u64,
    separate_service: bool,
) -> Option<CpuPerCycle> {
    if cycles == 0 {
        return None;
    }
    let us = |after: f64, before: f64| (after - before).max(0.0) * 1e6 / cycles as f64;
    Some(CpuPerCycle {
        service_us: separate_service.then(|| us(after.service, before.service)),
        postgres_us: us(after.postgres, before.postgres),
        redis_us: us(after.redis, before.redis),
        generator_us: us(after.generator, before.generator),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_gives_its_name_and_cpu_seconds_even_with_parentheses_in_the_name() {
        let line = "4242 (post gres) (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 \
                    100 1000 10 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0";
        let (comm, seconds) = parse_stat(line).unwrap();
        assert_eq!(comm, "post gres) (x)");
        assert!((seconds - 3.0).abs() < 1e-9, "{seconds}");
    }

    #[test]
    fn cpu_per_cycle_divides_each_groups_delta_by_the_cycles() {
        let before = CpuReading {
            service: 1.0,
            postgres: 2.0,
            redis: 0.0,
            generator: 0.5,
        };
        let after = CpuReading {
            service: 1.5,
            postgres: 3.0,
            redis: 0.0,
            generator: 0.75,
        };
        let split = per_cycle(before, after, 1_000, true).unwrap();
        assert_eq!(split.service_us, Some(500.0));
        assert_eq!(split.postgres_us, 1_000.0);
        assert_eq!(split.generator_us, 250.0);
        assert!(
            per_cycle(before, after, 1_000, false)
                .unwrap()
                .service_us
                .is_none()
        );
        assert!(per_cycle(before, after, 0, true).is_none());
    }
}
