//! Reading rank, world size and local rank from whichever launcher started the process.

use crate::error::{CollectiveError, Result};

/// The environment variable that picks one launcher when several launchers' variables are set
/// and disagree (values: `torchrun`, `openmpi`, `pmi`, `slurm`).
pub const LAUNCHER_ENV: &str = "FSDP_LAUNCHER";

/// A launcher whose variables say which rank this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// torchrun-style `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (also what a user sets by hand).
    Torchrun,
    /// Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`.
    OpenMpi,
    /// MPICH / Intel MPI (Hydra, PMI): `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`.
    Pmi,
    /// Slurm's `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`.
    Slurm,
}

impl Launcher {
    /// Every launcher, in the order they are believed when several agree (the first one found
    /// is reported as the source).
    pub const ALL: [Launcher; 4] = [
        Launcher::Torchrun,
        Launcher::OpenMpi,
        Launcher::Pmi,
        Launcher::Slurm,
    ];

    /// The variables holding (rank, world size, local rank).
    pub fn vars(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Launcher::Torchrun => ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
            Launcher::OpenMpi => (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ),
            Launcher::Pmi => ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
            Launcher::Slurm => ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        }
    }

    /// The name [`LAUNCHER_ENV`] takes for it.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "openmpi",
            Launcher::Pmi => "pmi",
            Launcher::Slurm => "slurm",
        }
    }

    fn parse(v: &str) -> Option<Launcher> {
        match v.trim().to_ascii_lowercase().as_str() {
            "torchrun" | "torch" | "env" => Some(Launcher::Torchrun),
            "openmpi" | "ompi" | "mpirun" => Some(Launcher::OpenMpi),
            "pmi" | "mpich" | "hydra" | "intelmpi" => Some(Launcher::Pmi),
            "slurm" | "srun" => Some(Launcher::Slurm),
            _ => None,
        }
    }
}

/// Where this process sits in the job: rank, world size and local rank, from one launcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank among the processes on this node (picks the device), when the launcher says.
    pub local_rank: Option<usize>,
    /// The launcher the values were read from.
    pub launcher: Launcher,
}

type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

fn non_empty(lookup: Lookup<'_>, var: &'static str) -> Result<Option<String>> {
    match lookup(var) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Err(CollectiveError::InvalidEnv {
            var,
            value: v,
            reason: "it is empty".into(),
        }),
        Some(v) => Ok(Some(v.trim().to_string())),
    }
}

fn parse_num(var: &'static str, v: &str) -> Result<usize> {
    v.parse::<usize>().map_err(|e| CollectiveError::InvalidEnv {
        var,
        value: v.to_string(),
        reason: format!("not a non-negative integer ({e})"),
    })
}

/// One launcher's values (and the raw strings, for conflict messages).
struct Found {
    env: LaunchEnv,
    raw: [Option<String>; 3],
}

fn read_launcher(lookup: Lookup<'_>, l: Launcher) -> Result<Option<Found>> {
    let (rv, sv, lv) = l.vars();
    let rank = non_empty(lookup, rv)?;
    let size = non_empty(lookup, sv)?;
    let local = non_empty(lookup, lv)?;
    let (rank_s, size_s) = match (rank, size) {
        (None, None) => return Ok(None),
        (Some(_), None) => return Err(CollectiveError::MissingEnv { var: sv }),
        (None, Some(_)) => return Err(CollectiveError::MissingEnv { var: rv }),
        (Some(r), Some(s)) => (r, s),
    };
    let rank = parse_num(rv, &rank_s)?;
    let world_size = parse_num(sv, &size_s)?;
    if world_size == 0 {
        return Err(CollectiveError::InvalidEnv {
            var: sv,
            value: size_s,
            reason: "there must be at least one rank".into(),
        });
    }
    if rank >= world_size {
        return Err(CollectiveError::InvalidEnv {
            var: rv,
            value: rank_s,
            reason: format!("ranks are 0..{world_size} ({sv}={world_size})"),
        });
    }
    let local_rank = local.as_deref().map(|v| parse_num(lv, v)).transpose()?;
    Ok(Some(Found {
        env: LaunchEnv {
            rank,
            world_size,
            local_rank,
            launcher: l,
        },
        raw: [Some(rank_s), Some(size_s), local],
    }))
}

impl LaunchEnv {
    /// Reads the process environment (see [`LaunchEnv::from_lookup`]).
    pub fn from_env() -> Result<LaunchEnv> {
        LaunchEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads every launcher's variables through `lookup`.
    ///
    /// A launcher counts when its rank or world-size variable is set; it then needs both. When
    /// several count they must agree on rank and world size, and on the local rank where two
    /// give one, else [`CollectiveError::EnvConflict`] names one variable of each. Setting
    /// [`LAUNCHER_ENV`] reads only that launcher (for `mpirun` inside a Slurm batch script,
    /// say, where the batch step's `SLURM_PROCID` is not this process's rank). When none
    /// counts: [`CollectiveError::MissingEnv`] for `RANK`.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let lookup: Lookup<'_> = &lookup;
        if let Some(v) = non_empty(lookup, LAUNCHER_ENV)? {
            let Some(l) = Launcher::parse(&v) else {
                return Err(CollectiveError::InvalidEnv {
                    var: LAUNCHER_ENV,
                    value: v,
                    reason: "expected torchrun, openmpi, pmi or slurm".into(),
                });
            };
            return match read_launcher(lookup, l)? {
                Some(f) => Ok(f.env),
                None => Err(CollectiveError::MissingEnv { var: l.vars().0 }),
            };
        }
        let mut found: Vec<Found> = Vec::new();
        for l in Launcher::ALL {
            if let Some(f) = read_launcher(lookup, l)? {
                found.push(f);
            }
        }
        let Some((first, rest)) = found.split_first() else {
            return Err(CollectiveError::MissingEnv { var: "RANK" });
        };
        let mut local_from = first.env.local_rank.map(|_| first);
        for other in rest {
            let (a, b) = (first.env.launcher.vars(), other.env.launcher.vars());
            let conflict = |var_a, i: usize, var_b| CollectiveError::EnvConflict {
                var_a,
                value_a: first.raw[i].clone().unwrap_or_default(),
                var_b,
                value_b: other.raw[i].clone().unwrap_or_default(),
            };
            if other.env.rank != first.env.rank {
                return Err(conflict(a.0, 0, b.0));
            }
            if other.env.world_size != first.env.world_size {
                return Err(conflict(a.1, 1, b.1));
            }
            match (local_from, other.env.local_rank) {
                (Some(l), Some(x)) if l.env.local_rank != Some(x) => {
                    return Err(CollectiveError::EnvConflict {
                        var_a: l.env.launcher.vars().2,
                        value_a: l.raw[2].clone().unwrap_or_default(),
                        var_b: b.2,
                        value_b: other.raw[2].clone().unwrap_or_default(),
                    });
                }
                (None, Some(_)) => local_from = Some(other),
                _ => {}
            }
        }
        Ok(LaunchEnv {
            local_rank: local_from.and_then(|f| f.env.local_rank),
            ..first.env
        })
    }
}

/// The launch environment of a store rendezvous: where this process sits ([`LaunchEnv`], from
/// any common launcher) plus `MASTER_ADDR` and `MASTER_PORT`, where rank 0 hosts the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousEnv {
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank among the processes on this node, when the launcher says.
    pub local_rank: Option<usize>,
    /// The launcher rank and world size were read from.
    pub launcher: Launcher,
    /// Host of rank 0's store: the store binds exactly this address.
    pub master_addr: String,
    /// Port of rank 0's store.
    pub master_port: u16,
}

impl RendezvousEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<RendezvousEnv> {
        RendezvousEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `lookup` (for tests and custom launchers): the launcher's
    /// as [`LaunchEnv::from_lookup`] does, then `MASTER_ADDR` and `MASTER_PORT`.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<RendezvousEnv> {
        let launch = LaunchEnv::from_lookup(&lookup)?;
        let lookup: Lookup<'_> = &lookup;
        let get = |var: &'static str| -> Result<String> {
            non_empty(lookup, var)?.ok_or(CollectiveError::MissingEnv { var })
        };
        let master_addr = get("MASTER_ADDR")?;
        let port = get("MASTER_PORT")?;
        let master_port = match port.parse::<u16>() {
            Ok(p) if p > 0 => p,
            Ok(_) => {
                return Err(CollectiveError::InvalidEnv {
                    var: "MASTER_PORT",
                    value: port,
                    reason: "port 0 cannot be reached by the other ranks; pick a fixed port".into(),
                })
            }
            Err(e) => {
                return Err(CollectiveError::InvalidEnv {
                    var: "MASTER_PORT",
                    value: port.clone(),
                    reason: format!("not a TCP port 1..=65535 ({e})"),
                })
            }
        };
        Ok(RendezvousEnv {
            rank: launch.rank,
            world_size: launch.world_size,
            local_rank: launch.local_rank,
            launcher: launch.launcher,
            master_addr,
            master_port,
        })
    }

    /// Where this process sits, without the store's address.
    pub fn launch(&self) -> LaunchEnv {
        LaunchEnv {
            rank: self.rank,
            world_size: self.world_size,
            local_rank: self.local_rank,
            launcher: self.launcher,
        }
    }

    /// The device this process should drive: its local rank when the launcher gives one (the
    /// processes of a node take devices 0, 1, …), else its rank (a single-node job).
    pub fn device_ordinal(&self) -> usize {
        self.local_rank.unwrap_or(self.rank)
    }

    /// `MASTER_ADDR:MASTER_PORT` (IPv6 literals bracketed).
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.iter().find(|(kk, _)| kk == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn each_launcher_alone_is_read() {
        for l in Launcher::ALL {
            let (r, s, lr) = l.vars();
            let e = LaunchEnv::from_lookup(env(&[(r, "3"), (s, "8"), (lr, "1")])).unwrap();
            assert_eq!(
                e,
                LaunchEnv {
                    rank: 3,
                    world_size: 8,
                    local_rank: Some(1),
                    launcher: l
                }
            );
            let e = LaunchEnv::from_lookup(env(&[(r, "0"), (s, "1")])).unwrap();
            assert_eq!(e.local_rank, None);
            assert_eq!(
                LaunchEnv::from_lookup(env(&[(r, "0")])).unwrap_err(),
                CollectiveError::MissingEnv { var: s }
            );
            assert_eq!(
                LaunchEnv::from_lookup(env(&[(s, "2")])).unwrap_err(),
                CollectiveError::MissingEnv { var: r }
            );
            let e = LaunchEnv::from_lookup(env(&[(r, "2"), (s, "2")])).unwrap_err();
            assert!(matches!(e, CollectiveError::InvalidEnv { var, .. } if var == r));
            let e = LaunchEnv::from_lookup(env(&[(r, "0"), (s, "1"), (lr, "x")])).unwrap_err();
            assert!(matches!(e, CollectiveError::InvalidEnv { var, .. } if var == lr));
        }
        assert_eq!(
            LaunchEnv::from_lookup(env(&[])).unwrap_err(),
            CollectiveError::MissingEnv { var: "RANK" }
        );
    }

    #[test]
    fn device_ordinal_is_the_local_rank_of_every_launcher_else_the_rank() {
        let master = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
        for l in Launcher::ALL {
            let (r, s, lr) = l.vars();
            // Rank 5 of 8, the second process of its node: device 1, not 5.
            let mut vars = vec![(r, "5"), (s, "8"), (lr, "1")];
            vars.extend(master);
            let e = RendezvousEnv::from_lookup(env(&vars)).unwrap();
            assert_eq!((e.launcher, e.device_ordinal()), (l, 1));
            let mut vars = vec![(r, "3"), (s, "4")];
            vars.extend(master);
            let e = RendezvousEnv::from_lookup(env(&vars)).unwrap();
            assert_eq!(e.device_ordinal(), 3, "{l:?} without a local rank");
        }
    }

    #[test]
    fn agreeing_launchers_combine_and_conflicts_name_both_variables() {
        // srun + a script that exports RANK/WORLD_SIZE from Slurm's: they agree.
        let e = LaunchEnv::from_lookup(env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
        ]))
        .unwrap();
        assert_eq!(e.launcher, Launcher::Torchrun);
        assert_eq!(e.local_rank, Some(1), "local rank taken from Slurm");

        // mpirun inside an sbatch script: the batch step's SLURM_PROCID is 0.
        let mixed = [
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
        ];
        let err = LaunchEnv::from_lookup(env(&mixed)).unwrap_err();
        assert_eq!(
            err,
            CollectiveError::EnvConflict {
                var_a: "OMPI_COMM_WORLD_RANK",
                value_a: "2".into(),
                var_b: "SLURM_PROCID",
                value_b: "0".into(),
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("OMPI_COMM_WORLD_RANK") && msg.contains("SLURM_PROCID"));
        assert!(msg.contains("FSDP_LAUNCHER"), "{msg}");
        // ... resolved by naming the launcher.
        let mut picked = mixed.to_vec();
        picked.push((LAUNCHER_ENV, "openmpi"));
        let e = LaunchEnv::from_lookup(env(&picked)).unwrap();
        assert_eq!((e.rank, e.launcher), (2, Launcher::OpenMpi));
        picked.pop();
        picked.push((LAUNCHER_ENV, "slurm"));
        assert_eq!(LaunchEnv::from_lookup(env(&picked)).unwrap().rank, 0);
        picked.pop();
        picked.push((LAUNCHER_ENV, "pmi"));
        assert_eq!(
            LaunchEnv::from_lookup(env(&picked)).unwrap_err(),
            CollectiveError::MissingEnv { var: "PMI_RANK" }
        );
        picked.pop();
        picked.push((LAUNCHER_ENV, "lsf"));
        assert!(matches!(
            LaunchEnv::from_lookup(env(&picked)).unwrap_err(),
            CollectiveError::InvalidEnv {
                var: LAUNCHER_ENV,
                ..
            }
        ));

        let err = LaunchEnv::from_lookup(env(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("RANK", "1"),
            ("WORLD_SIZE", "3"),
        ]))
        .unwrap_err();
        assert!(matches!(
            err,
            CollectiveError::EnvConflict {
                var_a: "WORLD_SIZE",
                var_b: "PMI_SIZE",
                ..
            }
        ));
        let err = LaunchEnv::from_lookup(env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "0"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
        ]))
        .unwrap_err();
        assert!(matches!(
            err,
            CollectiveError::EnvConflict {
                var_a: "MPI_LOCALRANKID",
                var_b: "SLURM_LOCALID",
                ..
            }
        ));
    }
}
