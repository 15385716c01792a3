//! Prints this node's containers as the API server reports them.
//!
//! ```sh
//! NODE_NAME=$(hostname) cargo run -p lookout-informer --example watch_pods
//! ```

use lookout_informer::{Config, Informer};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // KUBECONFIG / ~/.kube/config / the in-cluster service account.
    let client = lookout_informer::client().await?;
    let node = std::env::var("NODE_NAME").map_err(|_| "set NODE_NAME to this node's name")?;
    let informer = Informer::new(client, Config::new(node));
    let mut print = |e: lookout_model::ContainerEvent| {
        println!("{}", serde_json::to_string(&e).unwrap_or_default())
    };
    informer
        .run(&mut print, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
    Ok(())
}
