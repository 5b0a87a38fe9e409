//! CPU time per process group from `/proc` (Linux), so a run can say where each cycle's CPU went:
//! the service, PostgreSQL, Redis and this load generator, each as `utime + stime` over the
//! measured window divided by the cycles completed in it.
//!
//! Processes are told apart by their command name: `redis-server`, and `credpool` other than this
//! process (every service process on the machine, replicas included). PostgreSQL is the server
//! the run uses: its postmaster and every process the postmaster started (backends and background
//! processes: the sum is the server's whole cost), found through the postmaster's process id, plus
//! the CPU of its children that have exited (the postmaster's `cutime + cstime`), so a backend that
//! ends during the window (a closed connection, an autovacuum worker) still counts, and another
//! PostgreSQL server on the same machine does not. When the server is not on this machine, every
//! `postgres` process is counted. Elsewhere than Linux nothing is read.

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

/// Reads every process's CPU time now; `None` where `/proc` cannot be read. `postmaster`: the
/// process id of the PostgreSQL server's postmaster ([`postmaster_of`]), when it runs here.
pub fn read(postmaster: Option<u32>) -> Option<CpuReading> {
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
        let Some(stat) = parse_stat(&stat) else {
            continue;
        };
        let server = match postmaster {
            Some(postmaster) => pid == postmaster || stat.parent == postmaster,
            None => stat.comm == "postgres",
        };
        match stat.comm {
            _ if pid == own => reading.generator += stat.seconds,
            "postgres" if server => {
                reading.postgres += stat.seconds;
                if Some(pid) == postmaster {
                    reading.postgres += stat.exited_children_seconds;
                }
            }
            "redis-server" => reading.redis += stat.seconds,
            "credpool" => reading.service += stat.seconds,
            _ => {}
        }
    }
    Some(reading)
}

/// The postmaster of the backend with process id `backend` (its parent), when that backend runs
/// on this machine (Linux).
pub fn postmaster_of(backend: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{backend}/stat")).ok()?;
    let stat = parse_stat(&stat)?;
    (stat.comm == "postgres").then_some(stat.parent)
}

/// What [`read`] takes from one `/proc/<pid>/stat` line.
#[derive(Debug)]
struct Stat<'a> {
    /// The command name.
    comm: &'a str,
    /// The parent's process id.
    parent: u32,
    /// `utime + stime`, in seconds.
    seconds: f64,
    /// `cutime + cstime`, in seconds: the CPU of children that have exited and been waited for.
    exited_children_seconds: f64,
}

/// One `/proc/<pid>/stat` line. The name sits in parentheses and may itself contain spaces and
/// parentheses: the fields after it start after the LAST `)`.
fn parse_stat(stat: &str) -> Option<Stat<'_>> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?;
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    // fields[0] is the state (field 3 of proc(5)); the parent is field 4, utime, stime, cutime
    // and cstime are fields 14 to 17
    let field = |n: usize| -> Option<f64> { fields.get(n - 3)?.parse().ok() };
    Some(Stat {
        comm,
        parent: fields.get(1)?.parse().ok()?,
        seconds: (field(14)? + field(15)?) / TICKS_PER_SECOND,
        exited_children_seconds: (field(16)? + field(17)?) / TICKS_PER_SECOND,
    })
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
    fn a_stat_line_gives_its_name_parent_and_cpu_seconds_even_with_parentheses_in_the_name() {
        let line = "4242 (post gres) (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 \
                    100 1000 10 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0";
        let stat = parse_stat(line).unwrap();
        assert_eq!(stat.comm, "post gres) (x)");
        assert_eq!(stat.parent, 1);
        assert!((stat.seconds - 3.0).abs() < 1e-9, "{stat:?}");
        assert!(stat.exited_children_seconds.abs() < 1e-9, "{stat:?}");
    }

    /// A process named `postgres` (a copy of /bin/sh in `dir`) running `script`.
    fn fake_postgres(dir: &std::path::Path, script: &str) -> std::process::Child {
        std::process::Command::new(dir.join("postgres"))
            .args(["-c", script])
            .spawn()
            .unwrap()
    }

    /// Waits until `done` holds, looking every 20 ms for at most 60 seconds.
    fn until(mut done: impl FnMut() -> bool, what: &str) {
        for _ in 0..3_000 {
            if done() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!("{what}");
    }

    /// `/proc/<pid>/stat` of a process of this test.
    fn stat_of(pid: u32) -> (f64, f64, u32) {
        let line = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let stat = parse_stat(&line).unwrap();
        (stat.seconds, stat.exited_children_seconds, stat.parent)
    }

    #[test]
    fn a_server_is_its_postmaster_its_children_and_the_children_that_exited_and_no_other() {
        // Two stand-ins for PostgreSQL servers (processes named `postgres`): the first a
        // "postmaster" whose "backend" burns CPU and exits, the second a busy server of its own.
        // The first server's reading is its postmaster's CPU plus its exited backend's, exactly;
        // the second's CPU is in the reading of every `postgres` (no postmaster known) only.
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy("/bin/sh", dir.path().join("postgres")).unwrap();
        let busy = "i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done";
        let backend = format!("'{}' -c '{busy}'", dir.path().join("postgres").display());
        let mut postmaster = fake_postgres(dir.path(), &format!("{backend}; sleep 60"));
        let mut other = fake_postgres(dir.path(), &format!("{busy}; sleep 60"));
        let pm = postmaster.id();
        // the backend runs under the postmaster, which postmaster_of finds
        let mut backend_pid = None;
        until(
            || {
                backend_pid = std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
                    let pid: u32 = e.file_name().to_str()?.parse().ok()?;
                    (pid != pm && postmaster_of(pid) == Some(pm)).then_some(pid)
                });
                backend_pid.is_some() || stat_of(pm).1 > 0.0
            },
            "the backend never ran",
        );
        // it exits, and its CPU moves to the postmaster's exited children
        until(|| stat_of(pm).1 >= 0.05, "the backend never finished");
        until(
            || stat_of(other.id()).0 >= 0.05,
            "the other server never ran",
        );
        let (own, exited, _) = stat_of(pm);
        let reading = read(Some(pm)).unwrap();
        assert!(
            (reading.postgres - (own + exited)).abs() < 0.015,
            "the server's reading {} is not its postmaster's {own} s and exited children's {exited} s",
            reading.postgres
        );
        let every = read(None).unwrap();
        assert!(
            every.postgres >= own + stat_of(other.id()).0 - 0.015,
            "every postgres: {} s",
            every.postgres
        );
        // this process is the generator, never a server
        assert!(read(Some(pm)).unwrap().generator > 0.0);
        postmaster.kill().unwrap();
        other.kill().unwrap();
        postmaster.wait().unwrap();
        other.wait().unwrap();
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
