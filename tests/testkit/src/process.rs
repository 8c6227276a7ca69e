//! `ferry-server` processes: [`ServerProcess`] and [`LoggedServer`].

/// A `ferry-server` process on `127.0.0.1:0`, found through its `listening on` line; killed when
/// dropped.
pub struct ServerProcess {
    pub child: std::process::Child,
    pub addr: String,
    /// `unix:PATH`, where it was started with `--unix`.
    pub unix: Option<String>,
}

impl ServerProcess {
    /// The process id, for reading its `/proc` entries.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `BINARY --listen 127.0.0.1:0 ARGS...` (a `ferry-server`: a test of the package that
/// owns it passes `env!("CARGO_BIN_EXE_ferry-server")`), with `FERRY_TOKEN` set to `token` if
/// given.
pub fn spawn_server(binary: &std::path::Path, args: &[&str], token: Option<&str>) -> ServerProcess {
    use std::io::BufRead;
    let mut command = std::process::Command::new(binary);
    command
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("FERRY_TOKEN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    if let Some(token) = token {
        command.env("FERRY_TOKEN", token);
    }
    let mut child = command.spawn().expect("ferry-server starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = std::io::BufReader::new(stdout);
    let mut read_address = || {
        let mut line = String::new();
        lines.read_line(&mut line).expect("a line");
        line.trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("expected `listening on ADDR`, got {line:?}"))
            .to_string()
    };
    let addr = read_address();
    let unix = args.contains(&"--unix").then(read_address);
    ServerProcess { child, addr, unix }
}

/// A `ferry-server` whose log (stderr) is kept, to be read once it has stopped.
pub struct LoggedServer {
    child: std::process::Child,
    /// The TCP address it listens on.
    pub addr: String,
}

impl LoggedServer {
    /// Starts `BINARY --listen 127.0.0.1:0 ARGS...` with `RUST_LOG=info` and the environment
    /// `env` (nothing of the caller's `FERRY_TOKEN`).
    pub fn start(binary: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> LoggedServer {
        use std::io::BufRead;
        let mut child = std::process::Command::new(binary)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("FERRY_TOKEN")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("ferry-server starts");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("a line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("expected `listening on ADDR`, got {line:?}"))
            .to_string();
        LoggedServer { child, addr }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stops it cleanly (SIGTERM, then its exit, so that every line it logged is written) and
    /// returns its log.
    pub fn stop(mut self) -> String {
        use std::io::Read;
        let term = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(term.success());
        let _ = self.child.wait();
        let mut log = String::new();
        self.child
            .stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut log)
            .expect("the log");
        log
    }
}
