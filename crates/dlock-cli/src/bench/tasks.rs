//! The bench's groups of tasks: joined in the order they finish, stopped at the first
//! failure, so no task goes on taking locks behind a failed run.

use tokio::task::JoinSet;

use crate::exit::Failure;

/// Every task's value, in the order the tasks finished; at the first failure the other
/// tasks are aborted and waited for, and that failure is returned.
pub async fn join_or_stop<T: 'static, E: 'static>(
    mut set: JoinSet<Result<T, E>>,
) -> Result<Vec<T>, Failure>
where
    Failure: From<E>,
{
    let mut done = Vec::with_capacity(set.len());
    while let Some(joined) = set.join_next().await {
        let failure = match joined {
            Ok(Ok(value)) => {
                done.push(value);
                continue;
            }
            Ok(Err(e)) => Failure::from(e),
            Err(e) => Failure::internal(e.to_string()),
        };
        set.shutdown().await;
        return Err(failure);
    }
    Ok(done)
}
