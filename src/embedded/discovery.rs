//! Finding the PostgreSQL server tools (`initdb`, `pg_ctl`) installed on the machine.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Where PostgreSQL server packages install their binaries on Debian-like
/// systems, one directory per major version (`/usr/lib/postgresql/15/bin`).
const VERSIONED_ROOT: &str = "/usr/lib/postgresql";

/// A pair of PostgreSQL server tools from one installation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgBinaries {
    /// Path of `initdb`.
    pub initdb: PathBuf,
    /// Path of `pg_ctl` (from the same directory as `initdb`).
    pub pg_ctl: PathBuf,
}

impl PgBinaries {
    /// Finds `initdb` and `pg_ctl` in one directory: first on `PATH`, in
    /// `PATH` order, then under `/usr/lib/postgresql/*/bin`, highest major
    /// version first. Returns `None` when no directory has both.
    pub fn find() -> Option<Self> {
        find_binaries(
            std::env::var_os("PATH").as_deref(),
            Path::new(VERSIONED_ROOT),
        )
    }
}

/// Searches `path_var` (a `PATH`-style list) and then `versioned_root/*/bin`
/// in descending version order for a directory holding both tools.
fn find_binaries(path_var: Option<&OsStr>, versioned_root: &Path) -> Option<PgBinaries> {
    let on_path = path_var
        .map(|p| std::env::split_paths(p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(versioned_bin_dirs(versioned_root))
        .find_map(|dir| {
            let initdb = dir.join("initdb");
            let pg_ctl = dir.join("pg_ctl");
            (is_executable(&initdb) && is_executable(&pg_ctl))
                .then_some(PgBinaries { initdb, pg_ctl })
        })
}

/// `root/*/bin`, sorted by the numeric version in `*`, highest first.
fn versioned_bin_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut versions: Vec<(Vec<u64>, OsString)> = entries
        .filter_map(Result::ok)
        .map(|e| {
            let name = e.file_name();
            (version_key(&name.to_string_lossy()), name)
        })
        .collect();
    versions.sort_by(|a, b| b.cmp(a));
    versions
        .into_iter()
        .map(|(_, name)| root.join(name).join("bin"))
        .collect()
}

/// "9.6" -> [9, 6], "15" -> [15]; anything non-numeric sorts lowest.
fn version_key(name: &str) -> Vec<u64> {
    name.split('.')
        .map(|part| part.parse::<u64>())
        .collect::<Result<Vec<_>, _>>()
        .unwrap_or_default()
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::EmbeddedError;

    fn make_tool(dir: &Path, name: &str, mode: u32) {
        fs::create_dir_all(dir).unwrap();
        let path = dir.join(name);
        fs::write(&path, "#!/bin/sh\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn version_keys_sort_numerically() {
        assert!(version_key("10") > version_key("9.6"));
        assert!(version_key("16") > version_key("15"));
        assert!(version_key("9.6") > version_key("9.5"));
        assert!(version_key("15") > version_key("beta"));
    }

    #[test]
    fn finds_highest_version_with_both_tools() {
        let root = tempfile::tempdir().unwrap();
        let versions = root.path().join("postgresql");
        for v in ["9.6", "10", "15"] {
            make_tool(&versions.join(v).join("bin"), "initdb", 0o755);
            make_tool(&versions.join(v).join("bin"), "pg_ctl", 0o755);
        }
        // 16 is incomplete (no pg_ctl), 17 has a non-executable pg_ctl.
        make_tool(&versions.join("16").join("bin"), "initdb", 0o755);
        make_tool(&versions.join("17").join("bin"), "initdb", 0o755);
        make_tool(&versions.join("17").join("bin"), "pg_ctl", 0o644);

        let found = find_binaries(None, &versions).expect("found");
        assert_eq!(found.initdb, versions.join("15/bin/initdb"));
        assert_eq!(found.pg_ctl, versions.join("15/bin/pg_ctl"));
    }

    #[test]
    fn path_wins_over_versioned_dirs() {
        let root = tempfile::tempdir().unwrap();
        let versions = root.path().join("postgresql");
        make_tool(&versions.join("15/bin"), "initdb", 0o755);
        make_tool(&versions.join("15/bin"), "pg_ctl", 0o755);
        let empty = root.path().join("empty");
        fs::create_dir_all(&empty).unwrap();
        let custom = root.path().join("custom");
        make_tool(&custom, "initdb", 0o755);
        make_tool(&custom, "pg_ctl", 0o755);

        let path = std::env::join_paths([&empty, &custom]).unwrap();
        let found = find_binaries(Some(&path), &versions).expect("found");
        assert_eq!(found.initdb, custom.join("initdb"));

        let path = std::env::join_paths([&empty]).unwrap();
        let found = find_binaries(Some(&path), &versions).expect("found");
        assert_eq!(found.pg_ctl, versions.join("15/bin/pg_ctl"));
    }

    #[test]
    fn nothing_found_gives_the_docker_hint() {
        let root = tempfile::tempdir().unwrap();
        let path = std::env::join_paths([root.path()]).unwrap();
        assert_eq!(
            find_binaries(Some(&path), &root.path().join("missing")),
            None
        );
        let msg = EmbeddedError::BinariesNotFound.to_string();
        assert!(msg.contains("docker compose up -d"), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }
}
