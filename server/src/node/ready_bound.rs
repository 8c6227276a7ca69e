//! `BudgetRoom`: the bound on a node's receive pool, the room left in the budgets of the devices
//! that draw from it, so that the pool keeps no ready memory no receive could be admitted into.

use std::sync::Arc;

use ferry_backend::BackendKind;
use ferry_memory::ReadyBound;

use crate::device::{Budget, DeviceHandle};

/// The room left in the budgets of the devices that draw receive buffers from the pool (Flex
/// devices, whose tensors keep them; GPU devices, whose staging is no larger than the tensor
/// their budget admitted). A receive is admitted only within its device's room, so it can never
/// draw more than their sum.
pub(super) struct BudgetRoom {
    budgets: Vec<(Arc<Budget>, u64)>,
}

impl BudgetRoom {
    /// The bound for `devices`, or `None` where one that draws from the pool has no budget
    /// (its room, and so the pool's, is unbounded) or none draws from it.
    pub(super) fn of(devices: &[DeviceHandle]) -> Option<BudgetRoom> {
        let budgets = devices
            .iter()
            .filter(|d| matches!(d.kind(), BackendKind::Flex | BackendKind::Wgpu))
            .map(|d| Some((d.budget().clone(), d.budget().limit()?)))
            .collect::<Option<Vec<_>>>()?;
        (!budgets.is_empty()).then_some(BudgetRoom { budgets })
    }
}

impl ReadyBound for BudgetRoom {
    fn room(&self) -> usize {
        let room = self
            .budgets
            .iter()
            .map(|(budget, limit)| limit.saturating_sub(budget.used()))
            .fold(0u64, u64::saturating_add);
        usize::try_from(room).unwrap_or(usize::MAX)
    }
}
