//! `lookout`: the node agent's command line (see the `lookout_agent` crate).

fn main() -> anyhow::Result<()> {
    lookout_agent::cli_main()
}
