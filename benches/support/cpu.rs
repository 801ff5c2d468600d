//! CPU seconds read from `/proc`: of one process, and of the local Postgres server. A file
//! of its own so that the peers' benches (`benches/peers/*`, separate packages) include the
//! same code with `#[path]` and report the same columns.

/// Clock ticks per second in `/proc/<pid>/stat` (`USER_HZ`, 100 on Linux).
const USER_HZ: f64 = 100.0;

/// CPU seconds of a process from `/proc/<pid>/stat`: its own user and system time, plus
/// (with `children`) that of the children it has waited for.
fn proc_stat_cpu_secs(pid: &str, children: bool) -> Option<(String, i64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`; comm may hold spaces, so split after the last ')'.
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat[open + 1..close].to_owned();
    let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
    // Fields after comm, 0-based: 1 ppid, 11 utime, 12 stime, 13 cutime, 14 cstime.
    let ppid = fields.get(1)?.parse().ok()?;
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let mut ticks = tick(11) + tick(12);
    if children {
        ticks += tick(13) + tick(14);
    }
    Some((comm, ppid, ticks / USER_HZ))
}

/// CPU seconds of one process (`"self"` or a pid).
pub fn process_cpu_secs(pid: &str) -> Option<f64> {
    proc_stat_cpu_secs(pid, false).map(|(_, _, secs)| secs)
}

/// CPU seconds of the local Postgres server: every live `postgres` process, plus the
/// postmaster's reaped children (backends that exited count in full, so a connection
/// closed between two snapshots is not lost). 0 when the server is not on this machine.
pub fn postgres_cpu_secs() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let mut processes = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Some((comm, ppid, _)) = proc_stat_cpu_secs(&name, false)
            && comm == "postgres"
        {
            processes.push((name.parse::<i64>().unwrap_or(0), ppid, name));
        }
    }
    let pids: std::collections::HashSet<i64> = processes.iter().map(|p| p.0).collect();
    processes
        .iter()
        .map(|(_, ppid, name)| {
            // The postmaster is the one postgres process whose parent is not postgres.
            let postmaster = !pids.contains(ppid);
            proc_stat_cpu_secs(name, postmaster).map_or(0.0, |(_, _, secs)| secs)
        })
        .sum()
}
